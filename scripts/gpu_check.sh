#!/usr/bin/env bash
# One device call: environment, GPU tests, kernel breakdown, layer benchmark. Logs under $OUT.
# usage (on the GPU machine, from the repo root): bash scripts/gpu_check.sh [quick|full]
set -uo pipefail
OUT=${OUT:-/tmp/sonicmoe_out}
mkdir -p "$OUT"
MODE=${1:-quick}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# the device copy has no .git: pass the commit in, e.g. SONICMOE_GIT_COMMIT=$(git rev-parse HEAD)
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
  echo "commit ${SONICMOE_GIT_COMMIT:-unknown}"
} 2>&1 | tee "$OUT/env.txt"
python3 -m pytest -q -x tests/ -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
python3 benchmarks/kernel_breakdown.py --json "$OUT/breakdown_7b.json" 2>&1 | tee "$OUT/breakdown.txt"
if [ "$MODE" = full ]; then
  python3 -m sonicmoe bench --preset granularity,iso-flops --no-plot --out "$OUT" --tag granularity 2>&1 | tail -40 | tee "$OUT/bench.txt"
  python3 -m sonicmoe bench --preset models --no-plot --out "$OUT" --tag models 2>&1 | tail -40 | tee "$OUT/bench_models.txt"
fi
echo "=== summary"; tail -3 "$OUT/gpu_tests.txt"; cat "$OUT/breakdown.txt"
