#!/usr/bin/env bash
# Create .venv and install tdist with its test and demo dependencies.
# torch is pinned to 2.13.0 (a CPU wheel on these machines): a looser request lets pip pick a
# newer CUDA build of several GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# the multi-host tests make network namespaces with iproute2's `ip` (as root); the etcd store
# and rendezvous tests start a private etcd server (the etcd-server package; its own service is
# not used); the srun test starts a private one-node SLURM (slurmctld, slurmd and munge's munged;
# their own services are not used)
missing=""
command -v ip >/dev/null 2>&1 || missing="$missing iproute2"
command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ] || missing="$missing etcd-server"
command -v slurmd >/dev/null 2>&1 || [ -x /usr/sbin/slurmd ] || missing="$missing slurmd slurmctld slurm-client"
command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ] || missing="$missing munge"
if [ -n "$missing" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# the project's bytecode, compiled here (0.1 s when it is up to date): where
# PYTHONDONTWRITEBYTECODE is set, Python writes none, and every process the tests start would
# compile tdist again as it imports it (0.35 s of each start, against 0.15 s from bytecode)
"$PWD/.venv/bin/python" -m compileall -q -j 0 src tests benchmarks examples >/dev/null || true
stamp=.venv/.tdist-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev,demo,mpi,metrics]" "torch==2.13.0"
.venv/bin/python -c "import torch, tdist; assert torch.__version__.startswith('2.13.0'), torch.__version__"
echo "$want" > "$stamp"
