#!/usr/bin/env bash
# One device call: environment, GPU tests, kernel breakdown, layer benchmark. Logs under $OUT.
# usage (on the GPU machine, from the repo root): bash scripts/gpu_check.sh [quick|full]
set -uo pipefail
OUT=${OUT:-/tmp/sonicmoe_out}
mkdir -p "$OUT"
MODE=${1:-quick}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
  git rev-parse HEAD 2>/dev/null || true
} 2>&1 | tee "$OUT/env.txt"
python3 -m pytest -q -x tests/ -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
python3 benchmarks/kernel_breakdown.py --json "$OUT/breakdown_7b.json" 2>&1 | tee "$OUT/breakdown.txt"
if [ "$MODE" = full ]; then
  python3 -m sonicmoe bench --preset granularity --out "$OUT" 2>&1 | tail -40 | tee "$OUT/bench.txt"
fi
echo "=== summary"; tail -3 "$OUT/gpu_tests.txt"; cat "$OUT/breakdown.txt"
