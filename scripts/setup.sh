#!/usr/bin/env bash
# Create .venv (if missing) and install the extension with its evaluation, scale-out and test extras,
# at the exact versions of constraints.txt.
# Idempotent: a second run only re-checks the install. Needs Python 3.10-3.12 and PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test]"
.venv/bin/python -c "import sglang, sglang_ext, sglang_ext.patches, hybrid_kernels, smg; print('sglang', sglang.__version__, '| sglang_ext', sglang_ext.__version__)"
