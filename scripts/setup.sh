#!/usr/bin/env bash
# Create .venv (if missing) and install the extension with its evaluation, scale-out and test extras,
# at the exact versions of constraints.txt.
# Idempotent: a second run only re-checks the install. Needs Python 3.10-3.12 and PyPI, and
# libibverbs1 (installed with apt-get when missing and run as root).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
# the Mooncake store's wheel (the test extra) links the system library libibverbs, even for TCP
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get install -y -qq libibverbs1 >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null; }
  else
    echo "setup: the Mooncake store needs the system library libibverbs1 (Debian/Ubuntu: sudo apt-get install libibverbs1)" >&2
    exit 1
  fi
fi
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test]"
.venv/bin/python -c "import sglang, sglang_ext, sglang_ext.patches, hybrid_kernels, smg, mooncake.store; print('sglang', sglang.__version__, '| sglang_ext', sglang_ext.__version__)"
