#!/usr/bin/env bash
# The whole check: set up, lint, type-check, test. Exits non-zero if any step fails.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh || exit 1
status=0
echo "== ruff"; .venv/bin/ruff check src tests benchmarks examples || status=1
echo "== mypy"; .venv/bin/mypy || status=1
# two worker processes (pytest-xdist), a test file's tests in one of them: the suite is mostly
# processes that wait on each other, so two streams keep both cores busy (-n 0: one stream)
echo "== pytest"; .venv/bin/pytest -q -p no:cacheprovider -n 2 --dist loadfile "$@" || status=1
exit $status
