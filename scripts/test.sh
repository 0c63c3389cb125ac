#!/usr/bin/env bash
# The whole check: set up, lint, type-check, test. Exits non-zero if any step fails.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh || exit 1
status=0
echo "== ruff"; .venv/bin/ruff check src tests benchmarks examples || status=1
echo "== mypy"; .venv/bin/mypy || status=1
# three worker processes (pytest-xdist), a test file's tests in one of them: the suite is mostly
# processes that wait on each other (timeouts, peers, restarts), and two streams left a quarter
# of the two cores idle; three took 7:35 where two took 8:24-8:58 (-n 0: one stream)
# (--max-worker-restart=0: a worker that dies, a test past its timeout among the causes (the
# thread method ends the process), fails the run naming its test; replaced, with --dist loadfile,
# it left the run waiting forever: pytest-xdist issue 784)
echo "== pytest"; .venv/bin/pytest -q -p no:cacheprovider -n 3 --dist loadfile --max-worker-restart=0 "$@" || status=1
exit $status
