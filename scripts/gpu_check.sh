#!/usr/bin/env bash
# One device call: the GPU work of a session, logs and results under $OUT, a short summary last.
# usage (on the GPU machine, from the repo root): bash scripts/gpu_check.sh STEP [STEP ...]
#   quick  environment, every test (GPU-marked ones included) and the 7B kernel breakdown
#   tune   tile sweep of the leading configs with/without TMA weight loads (benchmarks/tune_sweep.py)
#   tr     token rounding vs top-k on the token_rounding sweeps (triton backend)
#   trq    token-rounding quality: train top-k and token rounding at E=64, K=2 on the same tokens
#   train  the h100 preset for 2000 steps on the triton and the torch backend (same seed, same data)
#   full   the layer benchmark on the granularity, iso-FLOPs and model shapes
# The device copy has no .git: pass the commit in, e.g. SONICMOE_GIT_COMMIT=$(git rev-parse HEAD).
set -uo pipefail
OUT=${OUT:-/tmp/sonicmoe_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
[ $# -eq 0 ] && set -- quick
SUMMARY=()
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
  echo "commit ${SONICMOE_GIT_COMMIT:-unknown}"
} 2>&1 | tee "$OUT/env.txt"

train() {  # train NAME [options...]: one run, its log.json and stdout copied to $OUT/train_NAME.*
  local name=$1; shift
  python3 -m sonicmoe train --preset h100 --no-progress --save-every 0 --out "/tmp/train_$name" "$@" \
    > "$OUT/train_$name.txt" 2>&1
  cp "/tmp/train_$name/log.json" "$OUT/train_$name.json" 2>/dev/null
  tail -2 "$OUT/train_$name.txt"
}

for step in "$@"; do
  case $step in
    quick)
      timeout 420 python3 -m pytest -q -rs tests/ -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
      python3 benchmarks/kernel_breakdown.py --json "$OUT/breakdown_7b.json" > "$OUT/breakdown.txt" 2>&1
      SUMMARY+=("$(grep -E '^(FAILED|ERROR)' "$OUT/gpu_tests.log" | head -20)" "$(tail -1 "$OUT/gpu_tests.log")"
                "$(cat "$OUT/breakdown.txt")")
      ;;
    tune)
      for k in up_proj dh down_proj dxtilde; do  # one process per kernel: a fault stays contained
        timeout 150 python3 benchmarks/tune_sweep.py --space focus --kernels $k --shape 24576,1536,256,128,8 \
          --shape 32768,4096,1024,128,8 --json "/tmp/tune_$k.json" 2>&1 | tee -a "$OUT/tune.txt"
      done
      python3 -c "import json,glob; print(json.dumps({p: json.load(open(p)) for p in sorted(glob.glob('/tmp/tune_*.json'))}))" \
        > "$OUT/tune_focus.json"
      SUMMARY+=("$(grep -E '^==|TF' "$OUT/tune.txt" | grep -v worst)")
      ;;
    tr)
      timeout 300 python3 -m sonicmoe bench --preset token-rounding --backends triton --no-router-variant \
        --no-check-grads --no-plot --out "$OUT" --tag token-rounding -q > "$OUT/tr.txt" 2>&1
      SUMMARY+=("$(tail -30 "$OUT/tr.txt")")
      ;;
    trq)
      common=(--experts 64 --top-k 2 --steps 600 --warmup 60 --eval-every 100 --profile-every 0)
      SUMMARY+=("$(train trq_topk "${common[@]}" --routing topk)")
      SUMMARY+=("$(train trq_tr "${common[@]}" --routing token_rounding)")
      ;;
    train)
      common=(--steps 2000 --warmup 100 --eval-every 250 --profile-every 500)
      train triton "${common[@]}" --backend triton &
      train torch "${common[@]}" --backend torch &
      wait
      SUMMARY+=("$(tail -2 "$OUT/train_triton.txt")" "$(tail -2 "$OUT/train_torch.txt")")
      ;;
    full)
      python3 -m sonicmoe bench --preset granularity,iso-flops --no-plot --out "$OUT" --tag granularity \
        > "$OUT/bench.txt" 2>&1
      python3 -m sonicmoe bench --preset models --no-plot --out "$OUT" --tag models > "$OUT/bench_models.txt" 2>&1
      SUMMARY+=("$(tail -30 "$OUT/bench.txt")" "$(tail -12 "$OUT/bench_models.txt")")
      ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
echo "=== summary"
printf '%s\n' "${SUMMARY[@]}"
