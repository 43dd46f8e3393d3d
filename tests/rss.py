"""Peak resident memory of a load, measured in a fresh process: the loaders' "never two copies" bound."""

import json
import subprocess
import sys

_SCRIPT = r"""
import json, sys, threading
{imports}
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
baseline, peak, done = status("VmRSS"), [0], threading.Event()
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the current RSS
    reset = True
except OSError:
    reset = False
def sample():  # the fallback where clear_refs is not permitted
    while not done.wait(0.002):
        peak[0] = max(peak[0], status("VmRSS"))
threading.Thread(target=sample, daemon=True).start()
{load}
done.set()
print(json.dumps(dict(baseline=baseline, final=status("VmRSS"), sampled=peak[0], hwm=status("VmHWM") if reset else 0,
                      expert_bytes={expert_bytes})))
"""


def peak_rss(imports: str, load: str, expert_bytes: str, path) -> dict:
    """Run ``load`` (code reading ``sys.argv[1]`` = ``path``, after ``imports``) in a fresh process; ``expert_bytes``:
    an expression of the bytes the load keeps packed. Returns the process's RSS before and after the load and at
    its peak (VmHWM, or sampling), and ``ratio`` = (peak - baseline) / (final - baseline)."""
    script = _SCRIPT.format(imports=imports, load=load, expert_bytes=expert_bytes)
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout.splitlines()[-1])
    m["peak"] = max(m["sampled"], m["hwm"])
    m["ratio"] = (m["peak"] - m["baseline"]) / (m["final"] - m["baseline"])
    print({k: round(v / 2**20, 1) for k, v in m.items() if v and k != "ratio"},
          f"peak / final over baseline {m['ratio']:.3f}")
    return m
