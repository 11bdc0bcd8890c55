#!/usr/bin/env bash
# The GPU preset (benchmarks/gpu.py): from the repository root on a lent GPU,
#   bash benchmarks/gpu.sh
# records step time, peak memory, float8 GEMMs and a profile into benchmarks/RESULTS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
exec timeout 480 python -m benchmarks.gpu "$@"
