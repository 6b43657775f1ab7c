#!/usr/bin/env bash
# Triton kernels vs their torch twins on a CUDA GPU (tests/kernels/triton_cases.py, the same cases the
# CPU suite runs in Triton's interpreter). Needs only a Python with torch, triton and pytest, and this
# repository: no SGLang, no transformers, no install (hybrid_kernels is put on PYTHONPATH).
#   bash kernels/run_gpu_checks.sh            # PYTHON=/path/to/python to pick the interpreter
#   bash kernels/run_gpu_checks.sh -k rerotate   # extra arguments go to pytest
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
cd "$ROOT"
unset TRITON_INTERPRET
"$PY" - <<'PY'
import sys
try:
    import pytest, torch, triton  # noqa: F401
except ImportError as e:
    sys.exit(f"run_gpu_checks: missing {e.name} (needs torch, triton and pytest)")
if not torch.cuda.is_available():
    sys.exit("run_gpu_checks: no CUDA device visible (on CPU run: pytest tests/kernels)")
print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name(0)}")
PY
PYTHONPATH="$ROOT/kernels${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m pytest -q -p no:cacheprovider \
    --confcutdir tests/kernels tests/kernels/test_triton_kernels.py "$@"
