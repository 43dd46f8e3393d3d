"""The machine a benchmark ran on, for its report and for ``hetmoe doctor``: memory, last-level cache, CPU model,
the commit, and the JSON a benchmark writes."""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess

import torch

from hetmoe import cpu

GB = 1e9


def mem_total_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemTotal not found in /proc/meminfo")


def llc_bytes() -> int:
    """Size of the last-level cache seen by CPU 0 (0 when sysfs does not say)."""
    best = (0, 0)
    base = "/sys/devices/system/cpu/cpu0/cache"
    for index in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        try:
            level = int(open(f"{base}/{index}/level").read())
            size = open(f"{base}/{index}/size").read().strip()
        except (OSError, ValueError):
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        best = max(best, (level, int(size.rstrip("KMG")) * mult))
    return best[1]


def git_commit() -> str:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        run = lambda *cmd: subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=5)  # noqa: E731
        head = run("git", "rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return ""
        dirty = run("git", "status", "--porcelain", "--untracked-files=no").stdout.strip()
        return head.stdout.strip() + (" (dirty)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return ""


def write_json(dest: str, doc: dict, say) -> None:
    """A benchmark's results as JSON to ``dest`` ('-' = stdout)."""
    text = json.dumps(doc, indent=1)
    if dest == "-":
        print(text)
    else:
        with open(dest, "w") as f:
            f.write(text + "\n")
        say(f"wrote {dest}")


def machine_info(pool: cpu.WorkerPool) -> dict:
    info = cpu.cpu_info()
    return {
        "hostname": socket.gethostname(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "commit": git_commit(),
        "cpu_model": cpu_model(),
        "cpu_flags": info["flags"],
        "best_isa": info["best_isa"],
        "isa_cap": info["isa_cap"],
        "physical_cores": info["physical_cores"],
        "threads": pool.threads,
        "pinned_cpus": pool.pinned_cpus,
        "mem_total_gb": mem_total_bytes() / GB,
        "llc_mb": llc_bytes() / (1 << 20),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    except OSError:
        return ""


def check_isa(isa: str) -> None:
    """Refuses an ISA this CPU cannot run before anything executes its instructions."""
    supported = cpu.cpu_info()["supported_isas"]
    if isa not in ("auto", cpu.AMX_EMULATED) and isa not in supported:
        raise ValueError(f"--isa {isa}: this CPU runs only {', '.join(supported)} (or auto)")
