"""Tests of Triton kernels on a CPU, under Triton's interpreter, in a process of their own.

`TRITON_INTERPRET=1` must be set before Triton is imported: Triton's own jitted library
functions (`tl.sum`, `tl.max`, `tl.cumsum`, `tl.sigmoid`, ...) are interpreted only when it
was on at import. So a test that runs such kernels calls a function of its module in a new
Python started with the variable set.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_interpreted(test_file: str | Path, call: str, timeout: float = 600) -> None:
    """Run `call` (say `"compare(torch.bfloat16)"`, a call of a function of the test module at
    `test_file`, with `torch` imported) in a new Python under Triton's interpreter (one OpenMP
    thread, the tests and the project importable); AssertionError with its stderr unless it succeeds."""
    test_file = Path(test_file).resolve()
    tests = test_file.parent
    script = f"import torch, {test_file.stem} as t; t.{call}; print('ok')"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(tests), str(tests.parent)]))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout)
    if result.returncode != 0 or not result.stdout.strip().endswith("ok"):
        raise AssertionError(f"{call} under Triton's interpreter: exit {result.returncode}\n{result.stderr[-3000:]}")
