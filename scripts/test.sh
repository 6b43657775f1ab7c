#!/usr/bin/env bash
# The test command (README; CI runs exactly this): set up .venv if needed, then run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# lint + import order (pyproject.toml [tool.ruff]) and types of the pure cores ([tool.mypy])
.venv/bin/ruff check .
.venv/bin/mypy
# two workers (pytest-xdist), one test module per worker at a time (module-scoped servers boot once;
# tests/conftest.py gives each worker and its servers one compute thread), modules handed out in
# collection order, the longest first (tests/conftest.py: LONGEST_FIRST), and the 25 slowest
# set-ups / calls listed at the end; a later `-n 0` runs everything in this process
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
    --durations=25 tests "$@"
