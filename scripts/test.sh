#!/usr/bin/env bash
# The test command (README; CI runs exactly this): set up .venv if needed, then run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# lint + import order (pyproject.toml [tool.ruff]) and types of the pure cores ([tool.mypy])
.venv/bin/ruff check .
.venv/bin/mypy
# the 25 slowest set-ups / calls are listed at the end of every run
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 tests "$@"
