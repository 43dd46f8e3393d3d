"""GPU tests that can hit an illegal memory access run their steps in a child process: such an error poisons the
CUDA context, so in-process it fails every later test too, and it is reported at a later call than the one at
fault. The child runs with CUDA_LAUNCH_BLOCKING=1 (each kernel reports its own error) and announces every step
before it runs it; a failed child fails the one test, naming the step."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP = "step: "


def say(what: str) -> None:
    """In the child: the step about to run."""
    print(STEP + what, flush=True)


def run_steps(test_file: str, *args: str, timeout: int = 420) -> list:
    """``python <test_file> <args>`` in a child process (the file's ``__main__`` runs the steps) -> the steps it
    announced; asserts it finished, else names the step it died in, with the end of its stderr."""
    path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, test_file, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    sys.stdout.write(proc.stdout)  # the child's measurements, shown with -s or -rA
    steps = [line[len(STEP):] for line in proc.stdout.splitlines() if line.startswith(STEP)]
    where = f"in step {len(steps)}, {steps[-1]!r}" if steps else "before its first step"
    assert proc.returncode == 0, f"the child died (exit {proc.returncode}) {where}:\n{proc.stderr[-4000:]}"
    return steps
