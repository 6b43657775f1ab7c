"""Triton kernels vs their torch twins (cases in `triton_cases.py`).

On a CUDA GPU (`kernels/run_gpu_checks.sh`), or when TRITON_INTERPRET=1 was set before Python
started, the cases run here. Otherwise (CPU test runs) they run in a fresh Python process with
TRITON_INTERPRET=1: Triton reads that setting when `triton.language` and each kernel are first
defined (and when a kernel launches), and SGLang's modules imported elsewhere in the suite must keep
the normal Triton, so the interpreter cannot be switched on inside a shared test process without
affecting the other test modules or the servers they start.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

_IN_PROCESS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"

if _IN_PROCESS:
    from tests.kernels.triton_cases import *  # noqa: F401,F403
else:

    def test_triton_kernels_in_the_interpreter():
        here = Path(__file__).resolve()
        root = here.parents[2]
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--confcutdir", str(here.parent),
               str(here)]
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-8000:]}\n{done.stderr[-4000:]}"
        assert " passed" in done.stdout and "failed" not in done.stdout, done.stdout[-2000:]
