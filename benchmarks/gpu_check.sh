#!/usr/bin/env bash
# The GPU check as one command, from a clone (installed or not): installs the wheels found in .wheels/ (the
# published roundpipe and its beartype, say, on a machine that cannot reach a package index), then runs
# benchmarks/gpu.py, writing gpu_results.json into $OUT when it is set, else here. Arguments go to gpu.py.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if compgen -G ".wheels/*.whl" >/dev/null; then
    site="${TMPDIR:-/tmp}/gpu_check_site"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" .wheels/*.whl || exit 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
exec "$PYTHON" benchmarks/gpu.py --out "${OUT:-.}/gpu_results.json" "$@"
