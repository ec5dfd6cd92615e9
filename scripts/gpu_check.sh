#!/usr/bin/env bash
# One device call: the GPU work of a session, logs and results under $OUT, a short summary last.
# usage (on the GPU machine, from the repo root): bash scripts/gpu_check.sh STEP [STEP ...]
#   quick  environment, the GPU-marked tests and the 7B kernel breakdown
#   split  the GPU-marked tests of every file spread over several GPUs (SPLIT_GPUS, default 0 1 2; SPLIT_GROUPS, else
#          the slowest three files one per GPU and the rest dealt out)
#   splitx the GPU-marked tests on several GPUs through pytest-xdist, one worker per GPU (SPLIT_GPUS, default 0 1 2 3),
#          tests handed out one at a time (session 54: 147 passed on three H100s in 383 s); a GPU named more than once
#          gets that many workers (session 66: SPLIT_GPUS="0 0 0 0", 169 passed on one H200 in 326 s); SPLIT_MARK the
#          -m expression (default gpu, which includes the device-fixture tests: two calls on one H200, see below)
#   tune   tile sweep of candidate configs (benchmarks/tune_sweep.py --space TUNE_SPACE: focus (default),
#          focus2 or focus3) on TUNE_SHAPES (default: the 7B shape and (32768, 4096, 1024, 128, 8));
#          TUNE_REPEAT rounds, medians
#   fewrows  the pinned configs where experts have few rows against the many-row ones (tune_sweep.py --space focus4 and
#          the up-projection's two schedules), under top-k and token rounding, on FEWROWS_SHAPES (default
#          (16384, 1536, 256, E, 8) at E = 512 and 256: 256 and 512 rows per expert), FEWROWS_REPEAT rounds (3)
#   bench7b  the layer benchmark on the 7B shape and (32768, 4096, 1024, 128, 8): triton, torch, upper bound
#   skew   the same two shapes, triton and torch, with the random router's even load and with a trained model's
#          (--load-profile LOAD_PROFILE, default the committed h100-preset training run's log.json; SKEW_TRAIN_STEPS=N:
#          first train the h100 preset N steps and use its log, whose per-step sorted load the profile prefers)
#   wgorder  the weight gradients' tile order, busiest expert first against expert order (SONICMOE_WGRAD_ORDER): GPU
#          tests, fresh-process layer benchmarks alternating the two on a trained load (WGORDER_PROFILE) and the
#          random router's, WGORDER_ROUNDS rounds
#   wgprof every kernel of the layer on the random router's load and on a trained one (WGORDER_PROFILE), the weight
#          gradients in expert order and in load order (WGPROF_SHAPES)
#   graph  eager layer against CUDA-graph replay (kernel-bound time; GRAPH_SHAPES), host profile, launcher host times
#          and where each launcher's host time goes (Triton's launch path against the launcher's own Python)
#   host   the kernel-launch fast path: GPU tests, launcher host times, eager against graph replay (HOST_SHAPES) and
#          the h100 training preset's tokens/s, each with SONICMOE_FAST_LAUNCH=0 and 1
#   graphmoe  the graphed-layer GPU tests, then the h100 training preset eager against --graph-moe
#          (GRAPHMOE_STEPS, GRAPHMOE_ROUTINGS e.g. "topk token_rounding token_rounding:stochastic")
#   routing  top-k's routing metadata by the counting-sort kernels against torch's sort (SONICMOE_ROUTING_KERNEL):
#          GPU tests, the layer fuzz (SONICMOE_AUTOTUNE=0, ROUTING_FUZZ_EXAMPLES, default 3), host time at T = 8192, the
#          7B layer's eager / host / graph-replay times
#   upws   the Gluon up-projection: probe against Triton (UPWS_SHAPES, UPWS_CONFIGS, UPWS_PROBE_ARGS e.g. --routing
#          token_rounding, UPWS_PROBE_TAG to keep several probes of one call apart), GPU tests, 7B layer A/B
#          (UPWS_AB_VALUES, default 1,0; UPWS_AB_ARGS more ws_ab.py options, e.g. --warmup 1000)
#   dhws   the Gluon dH kernel: probe against Triton (DHWS_SHAPES, DHWS_CONFIGS EPI:NBUF[:BLOCK_N[:PART[:TMA_STORE[:BLOCK_K[:RING]]]]],...),
#          GPU tests, layer A/B
#   ds3    the DeepSeek-V3 shape (32768, 7168, 2048, 256, 8) forward+backward: check, speed, memory
#   tr     token rounding vs top-k on the token_rounding sweeps (triton backend)
#   trprof the token-rounding GPU tests and the per-kernel and routing-step times of top-k and token rounding
#          on TRPROF_SHAPES (default: the sparsest point of each token_rounding sweep)
#   roofline  per-kernel times against their FLOP and DRAM floors (benchmarks/roofline.py) on ROOF_SHAPES (top-k) and
#          ROOF_TR_SHAPES (top-k and token rounding), with the GPU's peaks measured in the same call
#   trq    token-rounding quality: train top-k and token rounding at E=64, K=2 on the same tokens
#   train  trq, and at the same time the h100 preset for 2000 steps on the triton backend and the first
#          1000 of the same schedule on the torch backend (same seed, same data)
#   cmp    2000 steps of the h100 preset on triton and torch at once, with the GPU determinism tests
#          (CMP_TESTS: other pytest arguments for the tests run meanwhile)
#   noise  a triton run of cmp's schedule with seed 1 (other initialisation and batches: the seed noise that
#          cmp's triton-vs-torch gap is judged against) and the token-rounding quality runs of trq for each
#          seed in TRQ_SEEDS (default "0 1"), all at once
#   ep     expert parallelism: its tests (two ranks) and benchmarks/ep_bench.py over the visible GPUs
#   shared the shared expert (MoE(shared_intermediate_size=...)): its GPU tests and the compile test, then
#          scripts/shared_expert_bench.py (SHARED_SHAPES: T,d,n,E,K,n_s ...; default the script's three)
#   sharedprof  every kernel of the shared expert alone (scripts/layer_profile.py at E = K = 1; SHAREDPROF_SHAPES)
#   activation  gpt-oss's clamped SwiGLU: its GPU tests (Gluon epilogues included; ACT_TEST_S), then
#          scripts/activation_bench.py (ACT_SHAPES, ACT_BENCH_S; ACT_AUTOTUNE=1 autotunes the Triton kernels; ACT_TEST_K
#          selects tests by pytest -k)
#   compile  the torch.compile and opcheck tests of tests/test_library.py
#   review the GPU repros of session 83's reviews (scripts/gpu_review/), each with a 120 s limit
#   orders the router orders, DeepSeek-V3's sigmoid_then_topk among them: GPU tests, benchmarks/router_orders.py
#          (ORDERS_SHAPES, ORDERS_ROUNDS, ORDERS_ROUTING=token_rounding), the h100 preset for ORDERS_STEPS steps with the
#          default and DeepSeek-V3's router
#   portable  the Triton kernels' "mma" tile family (common.tile_family: the configs for GPUs other than Hopper and
#          datacenter Blackwell) on this GPU: its GPU tests, then the layer with SONICMOE_TILE_FAMILY=mma and no Gluon
#          kernel against the default and against the torch backend on PORTABLE_SHAPES (default the 7B shape), checked
#   multi  the layer on a device that is not current (two GPUs) and under DistributedDataParallel, then `sonicmoe
#          train` data-parallel through torchrun against one process (MULTI_STEPS of the h100 preset; scripts/dp_compare.py)
#   gemmws the Gluon ping-pong GEMM (down-projection, dX̃): probe of its ring depths against Triton (GEMMWS_SHAPES,
#          GEMMWS_DXT_CONFIGS, GEMMWS_DOWN_CONFIGS), its GPU tests
#   ab     scripts/ws_ab.py: alternating layer rounds over AB_VALUES (switch combinations NAME=V+NAME=V,...; AB_ENV
#          names the switch of bare values) on AB_SHAPES (default the 7B shape), AB_ROUNDS rounds; AB_ARGS more
#          options (--graph: CUDA-graph replays; --warmup MS; --routing token_rounding)
#   rules  settled layer A/Bs of the Gluon up-projection, weight gradients and dH outside their rules (SONICMOE_GLUON_UP=all,
#          SONICMOE_GLUON_WGRAD=all, SONICMOE_GLUON_DH=all against 1; RULES_ENVS (default "UP WGRAD"; DH too),
#          RULES_UP_SHAPES, RULES_WGRAD_SHAPES, RULES_DH_SHAPES, RULES_VALUES, RULES_ROUNDS, RULES_WARMUP_MS)
#   targets  issue #4's protocol (TARGET_SHAPES name=T,d,n,E,K ... to run one of the two): TARGET_ROUNDS (default 5)
#          rounds, each a fresh process of the layer benchmark (TARGET_REP: its --rep, ms)
#          on the 7B shape (triton and torch) then one on (32768, 4096, 1024, 128, 8) (triton; round 1 also torch,
#          and the float32 check of both); the median over rounds of each shape's fwd+bwd and of the 7B torch
#          ratio is what counts (scripts/target_summary.py)
#   trsel  token rounding's selection kernel: the row held in registers against streamed once per counting pass, and
#          fanouts (benchmarks/tr_select_fanout.py on TRSEL_SHAPES T,d,E,K ..., TRSEL_ARGS more options, e.g.
#          --keys-tile 128:32:8), each mask checked against the twin
#   checkfx  the forward timed after each step of the bench's float32 check (scripts/check_effect_probe.py)
#   ranks  token rounding's pairs from the rank array: ranks_routing against nonzero_static (scripts/ranks_routing_probe.py)
#   trsync the static-length (sync-free) token rounding: its GPU tests (TRSYNC_TESTS adds more pytest arguments) and
#          router + routing + experts timed for top-k, token rounding with its host sync and without
#          (scripts/tr_sync_probe.py on TRSYNC_SHAPES, with TRSYNC_ARGS)
#   trlayer  every kernel of router + routing + experts forward+backward, top-k beside static token rounding
#          (scripts/tr_layer_profile.py on TRLAYER_SHAPES T,d,n,E,K ...)
#   energy joules per call of every kernel of the layer, of its dense cuBLAS twin and of the whole layer, with the
#          board's watts and SM clock (scripts/energy_probe.py; ENERGY_SHAPE, default the 7B shape)
#   gather the gather-fused kernels against contiguous rows, their MMAs alone, TMA loads and their dense twins, and the
#          weight gradients' warpgroup forms (scripts/gather_path_probe.py on GATHER_SHAPES, GATHER_KERNELS)
#   exposed  the column-block GPU test, the reserved aggregation's configs (SONICMOE_AGG_RESERVE_CONFIG,
#          scripts/reserve_probe.py), and the gather-fused kernels with and without the MMA warps' proxy fence
#          (gather_path_probe.py --kernels fence [--no-fence]); exposedab: layer A/Bs of the reserve's config at
#          120B-n1024 (a call of its own: both exceed one call's 10 minutes)
#   chunkab  fresh-process layer A/Bs of the backward's column-block width (SONICMOE_AGG_CHUNK: CHUNK_AB_WIDTHS,
#          default 2048 (the default) and 1024) at 120B-n1024, CHUNK_AB_ROUNDS rounds (5; about 3 minutes)
#   ftz    the SwiGLU sigmoid by ex2/rcp.approx.ftz (SONICMOE_SIGMOID_FTZ): GPU tests, the up-projection and dH alone
#          in both forms (FTZ_SHAPES), fresh-process layer A/Bs (FTZ_AB_SHAPES name=T,d,n,E,K ..., FTZ_AB_ROUNDS)
#   ncu    Nsight Compute profiles of single expert kernels (scripts/ncu_target.py; NCU_RUNS NAME:OP:SHAPE:ROUTING[:ENV=V])
#   profile  every kernel of a 7B layer call (scripts/layer_profile.py), autotuned and pinned configs
#   full   the layer benchmark on the granularity, iso-FLOPs and model shapes (granularity: the first two,
#          GRAN_PRESETS to choose; models: the last), backends FULL_BACKENDS (default triton,torch: the loop and
#          upper-bound backends took a whole call's time in session 31), no router variant
# The device copy has no .git: pass the commit in, e.g. SONICMOE_GIT_COMMIT=$(git rev-parse HEAD).
# Everything is written under a work folder and packed into $OUT/results.tgz at exit (the device tool
# returns at most 8 files); the summary is also $OUT/summary.txt.
set -uo pipefail
FINAL=${OUT:-/tmp/sonicmoe_out}
# GPU_CHECK_TAG keeps instances apart that run at once on one machine, one per GPU (CUDA_VISIBLE_DEVICES): each
# writes its own work folder, results_TAG.tgz and summary_TAG.txt
TAG=${GPU_CHECK_TAG:+_$GPU_CHECK_TAG}
OUT=/tmp/sonicmoe_work$TAG
rm -rf "$OUT"; mkdir -p "$OUT" "$FINAL"
# SM clock, power, temperature and the reasons the clock is held down, once a second: timings of one machine
# differ from another's by several percent (power and thermal limits), and this says why
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
  --format=csv -l 1 > "$OUT/gpu_clocks.csv" 2>&1 &
SMI_PID=$!
# a snapshot of the work folder at WATCHDOG_S (default 560 s): a call the device's 600 s limit kills never reaches the
# EXIT trap, and without it returned nothing of what its steps had written
# (its own file: a tar of the EXIT trap may run at the same time). Its output goes nowhere: a sleep that outlives the
# killed subshell kept a `gpu_check.sh ... | tail` pipe open until WATCHDOG_S (session 87 lost about 250 s of a call to it)
( sleep "${WATCHDOG_S:-560}"; tar czf "$FINAL/results${TAG}_snapshot.tgz" -C "$OUT" . 2>/dev/null ) >/dev/null 2>&1 </dev/null &
WATCH_PID=$!
pack() { kill "$SMI_PID" "$WATCH_PID" 2>/dev/null; tar czf "$FINAL/results$TAG.tgz" -C "$OUT" . 2>/dev/null; }
trap pack EXIT
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
[ $# -eq 0 ] && set -- quick
SUMMARY=()
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
  echo "commit ${SONICMOE_GIT_COMMIT:-unknown}"
} 2>&1 | tee "$OUT/env.txt"

# the trained load of the wgorder and wgprof steps: session 81's 150-step h100-preset log (per-step busiest expert 3.2x
# the mean)
WGORDER_PROFILE=${WGORDER_PROFILE:-benchmarks/results/2026-12-05_nvidia-h100_session81/train_skew_150steps.json}

train() {  # train NAME [options...]: one run; its log.json to $OUT/train_NAME.json, stdout to /tmp
  local name=$1; shift
  # log.json is rewritten at each save (every 500 steps): a run cut short by the time limit leaves one
  timeout "${TRAIN_LIMIT_S:-480}" python3 -m sonicmoe train --preset h100 --no-progress --save-every "${SAVE_EVERY:-500}" \
    --out "/tmp/train_$name" "$@" > "/tmp/train_$name.txt" 2>&1
  cp "/tmp/train_$name/log.json" "$OUT/train_$name.json" 2>/dev/null
}

rates() {  # rates LOG.json...: each training log's tokens/s and MoE share of the step, one line each
  for f in "$@"; do
    python3 -c "import json,sys; d=json.load(open(sys.argv[1]));
print(sys.argv[1].split('/')[-1], 'tokens/s', round(d['tokens_per_s']), 'moe share', round(d.get('moe_time_share') or 0, 3))" "$f"
  done
}
trace() {  # trace DTYPE LIMIT_S: every Triton launch of one training step logged and synchronised
  SONICMOE_AUTOTUNE=0 timeout "$2" python3 scripts/launch_trace.py --dtype "$1" > "$OUT/trace_$1.txt" 2>&1
}

for step in "$@"; do
  case $step in
    quick)
      # the GPU-marked tests (the rest run on CPU in CI; natively each would compile its own kernels)
      # TESTS_PATHS: other test files or node ids (default: all of tests/). On a CUDA machine that is 527 tests (the
      # device-fixture ones are marked gpu there): more than TESTS_LIMIT_S allows in one process (session 82's count;
      # sessions 74-76 needed two splitx calls of four workers). Name files here, or use splitx for the whole set
      timeout ${TESTS_LIMIT_S:-480} python3 -m pytest -rA -m gpu --durations=0 ${TESTS_PATHS:-tests/} \
        -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
      # SKIP_BREAKDOWN=1 when something else shares the GPU (its timings would mean nothing)
      [ "${SKIP_BREAKDOWN:-0}" = 1 ] ||
        timeout "${BREAKDOWN_LIMIT_S:-90}" python3 benchmarks/kernel_breakdown.py --json "$OUT/breakdown_7b.json" \
          > "$OUT/breakdown.txt" 2>&1
      touch "$OUT/breakdown.txt"
      SUMMARY+=("$(grep -E '^(FAILED|ERROR)' "$OUT/gpu_tests.log" | head -20)" "$(tail -1 "$OUT/gpu_tests.log")"
                "$(cat "$OUT/breakdown.txt")")
      ;;
    split)
      # the GPU-marked tests of every file, spread over several GPUs of one machine (a multi-GPU kind): one pytest
      # process per group of files on its own GPU (SPLIT_GPUS, default 0 1 2). Groups: SPLIT_GROUPS (';'-separated),
      # else the three slowest files (session 37: about 5 minutes each group) one per group and every other
      # tests/test_*.py dealt out in turn
      read -ra gpus <<< "${SPLIT_GPUS:-0 1 2}"
      if [ -n "${SPLIT_GROUPS:-}" ]; then
        IFS=';' read -ra groups <<< "$SPLIT_GROUPS"
      else
        groups=()
        heavy=(tests/test_fuzz.py tests/test_library.py tests/test_kernels.py)
        for i in "${!gpus[@]}"; do groups[i]="${heavy[i]:-}"; done
        i=0
        for f in tests/test_*.py; do
          case " ${heavy[*]} " in *" $f "*) continue ;; esac
          groups[i]="${groups[i]} $f"
          i=$(( (i + 1) % ${#gpus[@]} ))
        done
        for f in "${heavy[@]:${#gpus[@]}}"; do groups[0]="${groups[0]} $f"; done  # fewer GPUs than heavy files
      fi
      pids=()
      for i in "${!groups[@]}"; do
        # shellcheck disable=SC2086
        CUDA_VISIBLE_DEVICES=${gpus[$i]} timeout ${TESTS_LIMIT_S:-480} python3 -m pytest -rA -m gpu --durations=0 \
          ${groups[$i]} -p no:cacheprovider > "$OUT/gpu_tests_g$i.log" 2>&1 &
        pids+=($!)
      done
      wait "${pids[@]}"
      for i in "${!groups[@]}"; do
        SUMMARY+=("group $i (GPU ${gpus[$i]}):${groups[$i]}" "$(grep -E '^(FAILED|ERROR)' "$OUT/gpu_tests_g$i.log" | head -20)"
                  "$(tail -1 "$OUT/gpu_tests_g$i.log")")
      done
      ;;
    splitx)
      # every GPU-marked test, one pytest-xdist worker per GPU (SPLIT_GPUS, default 0 1 2 3), tests handed out one at a
      # time to whichever worker is free (tests/conftest.py pins worker gwI to the I-th GPU through SONICMOE_TEST_GPUS):
      # `split` deals whole files without their durations, and its group with test_kernels.py ran out of time in
      # session 52. Needs pytest-xdist on the machine (the GPU image has 3.8). Session 54: every GPU-marked test passed
      # on three H100 workers in 383 s.
      read -ra gpus <<< "${SPLIT_GPUS:-0 1 2 3}"
      list=$(IFS=,; echo "${gpus[*]}")
      # since session 74 `-m gpu` also selects the device-fixture tests (213 more; 257 s on four workers of one H200
      # against 348 s for the rest): SPLIT_MARK="gpu and not device_fixture" and SPLIT_MARK=device_fixture split the
      # suite over two calls of the 10-minute limit
      # -v names each test's outcome as it ends ("[gw1] [ 36%] FAILED tests/..."): session 93's device-fixture run was
      # cut by the time-out after one F, and without -v the log never said which test it was. SPLIT_PATHS narrows the
      # run to some files (default tests), to split a suite over calls by file.
      read -ra paths <<< "${SPLIT_PATHS:-tests}"
      SONICMOE_TEST_GPUS=$list timeout ${TESTS_LIMIT_S:-480} python3 -m pytest -v -rA -m "${SPLIT_MARK:-gpu}" \
        -n "${#gpus[@]}" --dist load --durations=0 "${paths[@]}" -p no:cacheprovider > "$OUT/gpu_tests_xdist.log" 2>&1
      SUMMARY+=("GPU tests on ${#gpus[@]} workers ($list):"
                "$(grep -E '(^| )(FAILED|ERROR) ' "$OUT/gpu_tests_xdist.log" | sort -u | head -20)"
                "$(grep -cE ' PASSED ' "$OUT/gpu_tests_xdist.log") PASSED lines; last line: $(tail -1 "$OUT/gpu_tests_xdist.log")")
      ;;
    tune)
      shapes=()
      for sh in ${TUNE_SHAPES:-24576,1536,256,128,8 32768,4096,1024,128,8}; do shapes+=(--shape "$sh"); done
      for k in ${TUNE_KERNELS:-dh up_proj dw2 dw1 down_proj dxtilde aggregate}; do  # one process each: faults stay contained
        timeout ${TUNE_LIMIT_S:-100} python3 benchmarks/tune_sweep.py --space ${TUNE_SPACE:-focus} --kernels $k "${shapes[@]}" \
          --routing ${TUNE_ROUTING:-topk} --repeat ${TUNE_REPEAT:-1} \
          --json "$OUT/tune_$k.json" 2>&1 | tee -a "$OUT/tune.txt"
      done
      SUMMARY+=("$(grep -E '^==|TF|baseline|WRONG|failed' "$OUT/tune.txt" | grep -v ' 0 failed')")
      ;;
    fewrows)
      shapes=()
      for sh in ${FEWROWS_SHAPES:-16384,1536,256,512,8 16384,1536,256,256,8}; do shapes+=(--shape "$sh"); done
      for r in topk token_rounding; do
        timeout 250 python3 benchmarks/tune_sweep.py --space focus4 --repeat ${FEWROWS_REPEAT:-3} --routing $r \
          "${shapes[@]}" --json "$OUT/fewrows_$r.json" > "$OUT/fewrows_$r.txt" 2>&1
        timeout 150 python3 benchmarks/tune_sweep.py --space focus --kernels up_proj --repeat ${FEWROWS_REPEAT:-3} \
          --routing $r "${shapes[@]}" --json "$OUT/fewrows_up_$r.json" > "$OUT/fewrows_up_$r.txt" 2>&1
      done
      SUMMARY+=("$(grep -hE '^==|ms ' "$OUT"/fewrows_*.txt | grep -v worst)")
      ;;
    bench7b)
      python3 -m sonicmoe bench --preset 7b --shape 120b-n1024=32768,4096,1024,128,8 --backends triton,torch,upper \
        --no-plot --out "$OUT" --tag 7b > "$OUT/bench7b.txt" 2>&1
      SUMMARY+=("$(tail -12 "$OUT/bench7b.txt")")
      ;;
    skew)
      # the layer on a trained model's expert load (sonicmoe bench --load-profile: the committed h100-preset training
      # run's, LOAD_PROFILE) against the random router's near-even load, same shapes, same call
      profile=${LOAD_PROFILE:-benchmarks/results/2026-11-21_nvidia-h200_train/log.json}
      if [ -n "${SKEW_TRAIN_STEPS:-}" ]; then
        # a fresh h100-preset run first: its log (session 80 on) holds each step's sorted load, the typical step's
        # curve, which --load-profile prefers to the load summed over training
        train skew --steps "$SKEW_TRAIN_STEPS" --eval-every 0
        [ -f "$OUT/train_skew.json" ] && profile=$OUT/train_skew.json
      fi
      SUMMARY+=("skew profile: $profile")
      for prof in even trained; do
        lp=(); [ $prof = trained ] && lp=(--load-profile "$profile")
        timeout 280 python3 -m sonicmoe bench --preset 7b --shape 120b-n1024=32768,4096,1024,128,8 \
          --backends triton,torch --no-plot --no-router-variant "${lp[@]}" --out "$OUT/skew" --tag "$prof" \
          > "$OUT/skew_$prof.txt" 2>&1
        SUMMARY+=("skew $prof: $(grep -E '^(7B|120b)' "$OUT/skew_$prof.txt" | awk '{print $1, $3, $10, $11}' | tr '\n' ';')")
      done
      ;;
    wgorder)
      # the weight gradients' tile order (sonicmoe/ops/load_order.py; SONICMOE_WGRAD_ORDER: load, busiest expert first
      # and the persistent kernels' waves dealt serpentine, against expert index order, the default until this is measured):
      # the GPU tests, then fresh-process layer benchmarks of both orders
      # alternating, on a trained model's load (WGORDER_PROFILE, default session 81's 150-step h100-preset log, whose
      # per-step busiest expert took 3.2x the mean) and on the random router's, WGORDER_ROUNDS rounds (2)
      timeout 300 python3 -m pytest -rA -p no:cacheprovider tests/test_load_order.py tests/test_weight_grad_ws.py \
        tests/test_kernels.py -k "load_order or varlen_k or skew or matches_reference or dispatch or layer_uses_gluon" \
        > "$OUT/gpu_tests_wgorder.log" 2>&1
      profile=$WGORDER_PROFILE
      for i in $(seq 1 "${WGORDER_ROUNDS:-2}"); do
        for prof in trained even; do
          lp=(); [ $prof = trained ] && lp=(--load-profile "$profile")
          for order in expert load; do
            SONICMOE_WGRAD_ORDER=$order timeout 200 python3 -m sonicmoe bench --preset 7b \
              --shape 120b-n1024=32768,4096,1024,128,8 --backends triton --no-check --no-plot --no-router-variant \
              "${lp[@]}" --out "$OUT/wgorder" --tag "${prof}_${order}_r$i" > "$OUT/wgorder_${prof}_${order}_r$i.txt" 2>&1
            SUMMARY+=("wgorder $prof $order r$i: $(grep -E '^(7B|120b)' "$OUT/wgorder_${prof}_${order}_r$i.txt" \
              | awk '{print $1, $3, $10, $11}' | tr '\n' ';')")
          done
        done
      done
      SUMMARY+=("$(grep -E '^(FAILED|ERROR)' "$OUT/gpu_tests_wgorder.log")" "$(tail -n 1 "$OUT/gpu_tests_wgorder.log")")
      ;;
    wgprof)
      # where an uneven load costs: every kernel of the 7B layer and of (32768, 4096, 1024, 128, 8) (WGPROF_SHAPES) on
      # the random router's load and on a trained one (WGORDER_PROFILE), the weight gradients in expert order and in
      # load order (scripts/layer_profile.py --load-profile)
      profile=$WGORDER_PROFILE
      for sh in ${WGPROF_SHAPES:-24576,1536,256,128,8 32768,4096,1024,128,8}; do
        for run in even:expert trained:expert trained:load; do
          lp=(); [ "${run%%:*}" = trained ] && lp=(--load-profile "$profile")
          SONICMOE_WGRAD_ORDER=${run#*:} timeout 150 python3 scripts/layer_profile.py --shape "$sh" "${lp[@]}" \
            > "$OUT/wgprof_${sh//,/_}_${run/:/_}.txt" 2>&1
          SUMMARY+=("wgprof $sh $run: $(grep -E '^== fwd\+bwd' "$OUT/wgprof_${sh//,/_}_${run/:/_}.txt")")
        done
      done
      ;;
    graph)
      # the eager layer against CUDA-graph replay of the same kernels (the kernel-bound time), a host profile, and
      # each launcher's host time
      shapes=()
      for sh in ${GRAPH_SHAPES:-24576,1536,256,128,8}; do shapes+=(--shape "$sh"); done
      timeout ${GRAPH_LIMIT_S:-300} python3 scripts/graph_bound.py "${shapes[@]}" --profile --json "$OUT/graph_bound.json" \
        > "$OUT/graph_bound.txt" 2>&1
      timeout 120 python3 scripts/launch_overhead.py > "$OUT/launch_overhead.txt" 2>&1
      timeout 120 python3 scripts/launch_overhead.py --breakdown > "$OUT/launch_breakdown.txt" 2>&1
      SUMMARY+=("$(grep -E 'median|Error' "$OUT/graph_bound.txt")" "$(cat "$OUT/launch_overhead.txt")"
                "$(cat "$OUT/launch_breakdown.txt")")
      ;;
    host)
      # the kernel-launch fast path (sonicmoe/ops/fast_launch.py): its GPU tests, each launcher's host time and the
      # eager layer against a CUDA-graph replay (HOST_SHAPES) with the fast path off and on, then the h100 training
      # preset (HOST_TRAIN_STEPS steps) off, on, off, on
      timeout 400 python3 -m pytest -rA -m gpu tests/test_fast_launch.py ${HOST_TESTS:-} -p no:cacheprovider \
        > "$OUT/gpu_tests_host.log" 2>&1
      shapes=()
      for sh in ${HOST_SHAPES:-32768,768,256,64,8 24576,1536,256,128,8}; do shapes+=(--shape "$sh"); done
      for fl in 0 1; do
        SONICMOE_FAST_LAUNCH=$fl timeout 120 python3 scripts/launch_overhead.py --breakdown > "$OUT/launch_breakdown_fl$fl.txt" 2>&1
        SONICMOE_FAST_LAUNCH=$fl timeout 300 python3 scripts/graph_bound.py "${shapes[@]}" --rounds 3 \
          --json "$OUT/graph_bound_fl$fl.json" > "$OUT/graph_bound_fl$fl.txt" 2>&1
      done
      for run in 0a 1a 0b 1b; do
        SONICMOE_FAST_LAUNCH=${run:0:1} timeout 240 python3 -m sonicmoe train --preset h100 --steps ${HOST_TRAIN_STEPS:-60} \
          --no-progress --eval-every 0 --out "/tmp/train_fl$run" > "$OUT/train_fl$run.txt" 2>&1
        cp "/tmp/train_fl$run/log.json" "$OUT/train_fl$run.json" 2>/dev/null
      done
      SUMMARY+=("$(grep -E '^(FAILED|ERROR)' "$OUT/gpu_tests_host.log")" "$(tail -1 "$OUT/gpu_tests_host.log")"
                "$(head -20 "$OUT"/launch_breakdown_fl*.txt)" "$(grep -H median "$OUT"/graph_bound_fl*.txt)"
                "$(rates "$OUT"/train_fl*.json)")
      ;;
    graphmoe)
      # graphed MoE layers: their GPU tests (make_graphed_callables on the layer, sonicmoe train --graph-moe against
      # the eager run), then the h100 training preset (GRAPHMOE_STEPS steps) eager and graphed, alternating, under
      # each routing of GRAPHMOE_ROUTINGS (topk, token_rounding; token_rounding:stochastic for that subroutine)
      timeout 400 python3 -m pytest -rA -q -m gpu tests/test_train.py tests/test_library.py \
        -k "graph_moe or make_graphed" -p no:cacheprovider > "$OUT/gpu_tests_graphmoe.log" 2>&1
      for r in ${GRAPHMOE_ROUTINGS:-topk token_rounding}; do
        ropts=(--routing "${r%%:*}"); [ "${r#*:}" != "$r" ] && ropts+=(--rounding "${r#*:}")
        for run in eager_a graph_a eager_b graph_b; do
          g=--no-graph-moe; [ "${run%_*}" = graph ] && g=--graph-moe
          timeout 240 python3 -m sonicmoe train --preset h100 --steps "${GRAPHMOE_STEPS:-100}" "${ropts[@]}" $g \
            --no-progress --eval-every 0 --out "/tmp/train_${r/:/_}_$run" > "$OUT/train_${r/:/_}_$run.txt" 2>&1
          cp "/tmp/train_${r/:/_}_$run/log.json" "$OUT/train_${r/:/_}_$run.json" 2>/dev/null
        done
      done
      SUMMARY+=("$(grep -E '^(FAILED|ERROR)' "$OUT/gpu_tests_graphmoe.log")" "$(tail -1 "$OUT/gpu_tests_graphmoe.log")"
                "$(rates "$OUT"/train_*.json)")
      ;;
    routing)
      # top-k's routing by the counting-sort kernels (SONICMOE_ROUTING_KERNEL=1) against torch's sort: the GPU tests,
      # the layer's host time and where it goes (T = 8192), and the 7B layer eager / host / graph-replay times. Also
      # session 78's tests that came from planting bugs (scripts/mutation_probe.py), in bf16 on the GPU, and session 79's
      # large-logit pair scores (float32, natively)
      timeout "${ROUTING_TESTS_S:-300}" python3 -m pytest -rA -v --durations=15 -m gpu tests/test_topk_routing.py \
        tests/test_routing.py tests/test_kernels.py::test_up_proj_a_from_stored_h \
        tests/test_kernels.py::test_kernels_read_nothing_past_their_operands \
        tests/test_router_kernel.py::test_nan_logit_ranks_first_as_torch_topk \
        tests/test_router_kernel.py::test_sigmoid_renormalize_underflow_gives_zero_scores \
        tests/test_tr_scores.py::test_added_softmax_scores_stay_accurate_at_large_logits \
        -p no:cacheprovider > "$OUT/gpu_tests_routing.log" 2>&1
      # session 79's layer fuzz on its own, with pinned tiles and few examples: in session 80, natively with autotuning
      # and 5 examples, it did not finish in 150 s (each new configuration compiles, and autotunes, every kernel of the
      # layer; hypothesis prints nothing per example, so how far it got is unknown)
      SONICMOE_AUTOTUNE=0 SONICMOE_LAYER_FUZZ_EXAMPLES=${ROUTING_FUZZ_EXAMPLES:-3} timeout "${ROUTING_FUZZ_S:-240}" \
        python3 -m pytest -rA -v -m gpu tests/test_layer_fuzz.py -p no:cacheprovider > "$OUT/gpu_tests_layer_fuzz.log" 2>&1
      for v in 1 0 1 0; do
        SONICMOE_ROUTING_KERNEL=$v timeout 120 python3 scripts/layer_host_profile.py --shape 8192,1536,256,128,8 \
          --calls 50 --sections-only >> "$OUT/routing_sections_kernel$v.txt" 2>&1
      done
      for v in 1 0; do
        SONICMOE_ROUTING_KERNEL=$v timeout 200 python3 benchmarks/router_orders.py --shape 24576,1536,256,128,8 \
          --rounds 2 --graph > "$OUT/routing_orders_kernel$v.txt" 2>&1
      done
      SUMMARY+=("$(grep -h -E '^(FAILED|ERROR)' "$OUT"/gpu_tests_routing.log "$OUT"/gpu_tests_layer_fuzz.log)"
                "$(tail -n 1 "$OUT/gpu_tests_routing.log")" "$(tail -n 1 "$OUT/gpu_tests_layer_fuzz.log")"
                "$(grep -H 'host ms per call' "$OUT"/routing_sections_kernel*.txt)"
                "$(grep -H -E 'routing_from_topk|topk_routing$' "$OUT"/routing_sections_kernel*.txt)"
                "$(tail -n 6 "$OUT"/routing_orders_kernel*.txt)")
      ;;
    upws)
      # the Gluon up-projection: probe (bits, error, alternating timings against the Triton kernel), GPU tests, layer A/B
      shapes=()
      for sh in ${UPWS_SHAPES:-24576,1536,256,128,8 32768,4096,1024,128,8}; do shapes+=(--shape "$sh"); done
      [ "${UPWS_PROBE:-1}" = 1 ] && timeout ${UPWS_LIMIT_S:-240} python3 scripts/up_ws_probe.py "${shapes[@]}" ${UPWS_CONFIGS:+--configs $UPWS_CONFIGS} \
        ${UPWS_PROBE_ARGS:-} --json "$OUT/up_ws_probe${UPWS_PROBE_TAG:-}.json" > "$OUT/up_ws_probe${UPWS_PROBE_TAG:-}.txt" 2>&1
      [ "${UPWS_TESTS:-1}" = 1 ] &&
        timeout 400 python3 -m pytest -rA -m gpu tests/test_up_proj_ws.py ${UPWS_MORE_TESTS:-} -p no:cacheprovider \
          > "$OUT/gpu_tests_upws.log" 2>&1
      ab=()
      for sh in ${UPWS_AB_SHAPES:-24576,1536,256,128,8}; do ab+=(--shape "$sh"); done
      [ "${UPWS_AB:-1}" = 1 ] && timeout ${UPWS_AB_LIMIT_S:-300} python3 scripts/ws_ab.py --env SONICMOE_GLUON_UP \
        --values ${UPWS_AB_VALUES:-1,0} --rounds ${UPWS_AB_ROUNDS:-7} ${UPWS_AB_ARGS:-} "${ab[@]}" \
        --json "$OUT/ab_up.json" > "$OUT/ab_up.txt" 2>&1
      SUMMARY+=("$(grep -svE 'check' "$OUT/up_ws_probe${UPWS_PROBE_TAG:-}.txt" | tail -12)" "$(grep -sE 'check' "$OUT/up_ws_probe${UPWS_PROBE_TAG:-}.txt" | cut -c1-220)"
                "$(grep -sE '^(FAILED|ERROR)' "$OUT/gpu_tests_upws.log")" "$(tail -1 "$OUT/gpu_tests_upws.log" 2>/dev/null)"
                "$(grep -E 'SONICMOE_GLUON_UP=' "$OUT/ab_up.txt" 2>/dev/null)")
      ;;
    dhws)
      # the Gluon dH kernel: probe (against Triton: bits, error, alternating timings), GPU tests, 7B layer A/B
      shapes=()
      for sh in ${DHWS_SHAPES:-24576,1536,256,128,8}; do shapes+=(--shape "$sh"); done
      timeout ${DHWS_LIMIT_S:-200} python3 scripts/dh_ws_probe.py "${shapes[@]}" ${DHWS_CONFIGS:+--configs $DHWS_CONFIGS} \
        --json "$OUT/dh_ws_probe.json" > "$OUT/dh_ws_probe.txt" 2>&1
      [ "${DHWS_TESTS:-1}" = 1 ] &&
        timeout 400 python3 -m pytest -rA -m gpu tests/test_dh_ws.py ${DHWS_MORE_TESTS:-} -p no:cacheprovider \
          > "$OUT/gpu_tests_dhws.log" 2>&1
      ab=()
      for sh in ${DHWS_AB_SHAPES:-24576,1536,256,128,8}; do ab+=(--shape "$sh"); done
      # DHWS_AB_VALUES: the SONICMOE_GLUON_DH values compared (all,0 at widths outside the layer's rule, e.g. 7B)
      [ "${DHWS_AB:-1}" = 1 ] && timeout 300 python3 scripts/ws_ab.py --env SONICMOE_GLUON_DH --values ${DHWS_AB_VALUES:-1,0} \
        --rounds ${DHWS_AB_ROUNDS:-7} "${ab[@]}" --json "$OUT/ab_dh.json" > "$OUT/ab_dh.txt" 2>&1
      SUMMARY+=("$(grep -svE 'check' "$OUT/dh_ws_probe.txt" | tail -12)" "$(grep -sE 'check' "$OUT/dh_ws_probe.txt" | cut -c1-260)"
                "$(grep -sE '^(FAILED|ERROR)' "$OUT/gpu_tests_dhws.log")" "$(tail -1 "$OUT/gpu_tests_dhws.log" 2>/dev/null)"
                "$(grep -E 'SONICMOE_GLUON_DH=' "$OUT/ab_dh.txt" 2>/dev/null)")
      ;;
    multi)
      # the layer off the current device and under DistributedDataParallel (tests/test_multi_device.py; the 2-GPU
      # tests skip on one GPU), then `sonicmoe train` data-parallel through torchrun on every visible GPU (two ranks
      # sharing one GPU through gloo where there is one) against one process: MULTI_STEPS steps of the h100 preset
      # without the load-balancing loss (per rank), same global batch
      timeout 400 python3 -m pytest -rA tests/test_multi_device.py -p no:cacheprovider > "$OUT/gpu_tests_multi.log" 2>&1
      gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
      ranks=$(( gpus > 1 ? gpus : 2 ))
      opts=(--preset h100 --no-progress --steps "${MULTI_STEPS:-200}" --eval-every 100 --save-every 0
            --aux-loss-coef 0 --log-every 10)
      timeout 300 python3 -m sonicmoe train "${opts[@]}" --out /tmp/dp1 > "$OUT/train_dp1.txt" 2>&1
      timeout 300 python3 -m torch.distributed.run --standalone --nproc-per-node "$ranks" -m sonicmoe train \
        "${opts[@]}" --out /tmp/dp$ranks > "$OUT/train_dp$ranks.txt" 2>&1
      cp /tmp/dp1/log.json "$OUT/train_dp1.json"; cp /tmp/dp$ranks/log.json "$OUT/train_dp$ranks.json"
      SUMMARY+=("$(grep -sE '^(FAILED|ERROR|SKIPPED)' "$OUT/gpu_tests_multi.log")" "$(tail -1 "$OUT/gpu_tests_multi.log")"
                "$(python3 scripts/dp_compare.py "$OUT/train_dp1.json" "$OUT/train_dp$ranks.json" 2>&1)")
      ;;
    ep)
      # expert parallelism (tests/test_expert_parallel.py: two ranks, on two GPUs over NCCL or sharing one over gloo),
      # then benchmarks/ep_bench.py on every visible GPU through torchrun (one process where there is one GPU: the
      # dispatch, exchange and combine's own cost against the plain layer)
      timeout 300 python3 -m pytest -rA tests/test_expert_parallel.py -p no:cacheprovider > "$OUT/gpu_tests_ep.log" 2>&1
      gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
      timeout 300 python3 -m torch.distributed.run --standalone --nproc-per-node "$gpus" benchmarks/ep_bench.py \
        --out "$OUT/ep_bench.json" > "$OUT/ep_bench.txt" 2>&1
      SUMMARY+=("$(grep -sE '^(FAILED|ERROR|SKIPPED|XFAIL|XPASS)' "$OUT/gpu_tests_ep.log")" "$(tail -1 "$OUT/gpu_tests_ep.log")"
                "$(tail -4 "$OUT/ep_bench.txt")")
      ;;
    shared)
      # 280 + 280 s: both fit one device call, and the watchdog's snapshot keeps what finished
      timeout 280 python3 -m pytest -rA -p no:cacheprovider tests/test_shared_expert.py "tests/test_library.py::test_compile_fullgraph_module_dynamic_shapes" \
        > "$OUT/gpu_tests_shared.log" 2>&1
      timeout 280 python3 scripts/shared_expert_bench.py ${SHARED_SHAPES:+--shape $SHARED_SHAPES} \
        --json "$OUT/shared_expert_bench.json" > "$OUT/shared_expert_bench.txt" 2>&1
      SUMMARY+=("$(grep -sE '^(FAILED|ERROR)' "$OUT/gpu_tests_shared.log")" "$(tail -1 "$OUT/gpu_tests_shared.log")"
                "$(tail -4 "$OUT/shared_expert_bench.txt")")
      ;;
    sharedprof)
      # where the shared expert's time goes at 7B's d = 1536, n_s = 1024 (session 83, H100: ours 2.73 ms against
      # torch's dense 3-GEMM MLP 1.72 ms, while at d = 2048, n_s = 2816 ours was faster): every kernel of one expert
      # that every token routes to (E = K = 1, scores with a gradient as the gated shared expert's), SHAREDPROF_SHAPES
      for sh in ${SHAREDPROF_SHAPES:-24576,1536,1024,1,1 16384,2048,2816,1,1}; do
        timeout 150 python3 scripts/layer_profile.py --shape "$sh" > "$OUT/sharedprof_${sh//,/_}.txt" 2>&1
        SUMMARY+=("sharedprof $sh: $(grep -E '^== fwd\+bwd' "$OUT/sharedprof_${sh//,/_}.txt")")
      done
      ;;
    review)
      # session 83's review repros (scripts/gpu_review/README.md), each in its own process
      for f in scripts/gpu_review/*.py; do
        name=$(basename "$f" .py)
        timeout 120 python3 "$f" > "$OUT/review_${name}.txt" 2>&1
        SUMMARY+=("review $name: rc $? $(grep -cE '^FAIL' "$OUT/review_${name}.txt") FAIL lines; $(tail -1 "$OUT/review_${name}.txt")")
      done
      ;;
    activation)
      # gpt-oss's clamped SwiGLU and router bias (session 84): their GPU tests (bf16; the Gluon kernels' clamped
      # epilogues and the Triton kernels'), then scripts/activation_bench.py (ACT_SHAPES: T,d,n,E,K ...; default the 7B and
      # gpt-oss-120b shapes): fwd+bwd of each activation and the torch backend's, with a check against float32
      # (session 85: the clamped activation in the Gluon kernels' epilogues too; pinned Triton configs, as the bf16
      # tests' autotuning did not finish within the step in session 84)
      SONICMOE_AUTOTUNE=${ACT_AUTOTUNE:-0} timeout ${ACT_TEST_S:-300} python3 -m pytest -rA -p no:cacheprovider -m gpu \
        ${ACT_TEST_K:+-k "$ACT_TEST_K"} tests/test_activation.py tests/test_gpt_oss.py > "$OUT/gpu_tests_activation.log" 2>&1
      SONICMOE_AUTOTUNE=${ACT_AUTOTUNE:-0} timeout ${ACT_BENCH_S:-250} python3 scripts/activation_bench.py ${ACT_SHAPES:+--shape $ACT_SHAPES} \
        --json "$OUT/activation_bench.json" > "$OUT/activation_bench.txt" 2>&1
      SUMMARY+=("$(grep -sE '^(FAILED|ERROR)' "$OUT/gpu_tests_activation.log")" "$(tail -1 "$OUT/gpu_tests_activation.log")"
                "$(tail -3 "$OUT/activation_bench.txt")")
      ;;
    compile)
      # the torch.compile tests on the GPU (session 83: token rounding's selection became one custom-op node, so that
      # a dynamic-shape compile no longer recompiles per token count; first GPU run of that change)
      timeout 400 python3 -m pytest -rA -p no:cacheprovider tests/test_library.py -k "compile or opcheck" \
        > "$OUT/gpu_tests_compile.log" 2>&1
      SUMMARY+=("$(grep -sE '^(FAILED|ERROR)' "$OUT/gpu_tests_compile.log")" "$(tail -1 "$OUT/gpu_tests_compile.log")")
      ;;
    orders)
      # the router orders (DeepSeek-V3's sigmoid_then_topk with its selection bias and scaling, session 74): the GPU
      # tests of the router kernel, the layer and the training CLI's options; the layer and the router alone timed
      # per order (benchmarks/router_orders.py on ORDERS_SHAPES, ORDERS_ROUNDS rounds); then ORDERS_STEPS steps of
      # the h100 preset with the default router and with DeepSeek-V3's (sigmoid, renormalised, 2.5, bias updates
      # at 1e-3, no auxiliary loss), same seed and batches
      timeout 300 python3 -m pytest -rA -m gpu tests/test_router_kernel.py tests/test_module.py tests/test_routing.py \
        -p no:cacheprovider > "$OUT/gpu_tests_orders.log" 2>&1
      shapes=(); for sh in ${ORDERS_SHAPES:-24576,1536,256,128,8 32768,4096,1024,128,8}; do shapes+=(--shape "$sh"); done
      graph=(); [ "${ORDERS_GRAPH:-1}" = 1 ] && graph=(--graph)  # host time and CUDA-graph replays too (session 75)
      [ -n "${ORDERS_ROUTING:-}" ] && graph+=(--routing "$ORDERS_ROUTING")  # token_rounding (session 76)
      timeout 300 python3 benchmarks/router_orders.py "${shapes[@]}" --rounds "${ORDERS_ROUNDS:-3}" "${graph[@]}" \
        --json "$OUT/router_orders.json" > "$OUT/router_orders.txt" 2>&1
      steps=${ORDERS_STEPS:-300}  # 0: no training runs
      [ "$steps" -gt 0 ] && timeout 250 python3 -m sonicmoe train --preset h100 --steps "$steps" --eval-every 100 --save-every 0 \
        --no-progress --out "$OUT/train_default" > "$OUT/train_default.txt" 2>&1
      [ "$steps" -gt 0 ] && timeout 250 python3 -m sonicmoe train --preset h100 --steps "$steps" --eval-every 100 --save-every 0 \
        --router-order sigmoid_then_topk --renormalize --routed-scaling-factor 2.5 --bias-update-rate 1e-3 \
        --aux-loss-coef 0 --no-progress --out "$OUT/train_dsv3" > "$OUT/train_dsv3.txt" 2>&1
      rm -f "$OUT"/train_*/ckpt.pt  # GBs at the h100 preset: session 74's first call lost its results to them
      SUMMARY+=("$(grep -sE '^(FAILED|ERROR)' "$OUT/gpu_tests_orders.log" | head)" "$(tail -1 "$OUT/gpu_tests_orders.log")"
                "$(tail -12 "$OUT/router_orders.txt")" "default router: $(grep -s '^done' "$OUT/train_default.txt")"
                "$(grep -s '^expert load' "$OUT/train_default.txt")" "DeepSeek-V3 router: $(grep -s '^done' "$OUT/train_dsv3.txt")"
                "$(grep -s '^expert load' "$OUT/train_dsv3.txt")")
      ;;
    portable)
      timeout 400 python3 -m pytest -rA -m gpu tests/test_portable_configs.py -p no:cacheprovider \
        > "$OUT/gpu_tests_portable.log" 2>&1
      for sh in ${PORTABLE_SHAPES:-7b=24576,1536,256,128,8}; do
        tag=${sh%%=*}
        timeout 200 python3 -m sonicmoe bench --shape "$sh" --backends triton,torch --no-plot --rep 1000 \
          --out "$OUT/portable" --tag "$tag-default" > "$OUT/portable_$tag-default.txt" 2>&1
        SONICMOE_TILE_FAMILY=mma SONICMOE_GLUON=0 timeout 200 python3 -m sonicmoe bench --shape "$sh" \
          --backends triton,torch --no-plot --rep 1000 --out "$OUT/portable" --tag "$tag-mma" \
          > "$OUT/portable_$tag-mma.txt" 2>&1
        SUMMARY+=("$tag default: $(grep -hE 'triton: |torch: |check' "$OUT/portable_$tag-default.txt" | cut -c1-200)"
                  "$tag mma, no Gluon: $(grep -hE 'triton: |torch: |check' "$OUT/portable_$tag-mma.txt" | cut -c1-200)")
      done
      SUMMARY+=("$(grep -sE '^(FAILED|ERROR)' "$OUT/gpu_tests_portable.log")" "$(tail -1 "$OUT/gpu_tests_portable.log" 2>/dev/null)")
      ;;
    gemmws)
      # the Gluon ping-pong GEMM (down-projection and dX̃ forms): probe (against Triton: bits, error, alternating
      # timings; GEMMWS_DXT_CONFIGS, GEMMWS_DOWN_CONFIGS as BN:STAGES,...), GPU tests
      shapes=()
      for sh in ${GEMMWS_SHAPES:-24576,1536,256,128,8}; do shapes+=(--shape "$sh"); done
      timeout ${GEMMWS_LIMIT_S:-150} python3 scripts/dxt_ws_probe.py "${shapes[@]}" --form dxt \
        --configs ${GEMMWS_DXT_CONFIGS:-128:8,128:6} --json "$OUT/dxt_ws_probe.json" > "$OUT/dxt_ws_probe.txt" 2>&1
      timeout ${GEMMWS_LIMIT_S:-150} python3 scripts/dxt_ws_probe.py "${shapes[@]}" --form down \
        --configs ${GEMMWS_DOWN_CONFIGS:-128:16,128:12} --json "$OUT/down_ws_probe.json" > "$OUT/down_ws_probe.txt" 2>&1
      [ "${GEMMWS_TESTS:-1}" = 1 ] &&
        timeout 300 python3 -m pytest -rA -m gpu tests/test_grouped_gemm_ws.py -p no:cacheprovider \
          > "$OUT/gpu_tests_gemmws.log" 2>&1
      SUMMARY+=("$(grep -svE 'check' "$OUT/dxt_ws_probe.txt" | tail -6)" "$(grep -sE 'check' "$OUT/dxt_ws_probe.txt" | cut -c1-200)"
                "$(grep -svE 'check' "$OUT/down_ws_probe.txt" | tail -6)" "$(grep -sE 'check' "$OUT/down_ws_probe.txt" | cut -c1-200)"
                "$(grep -sE '^(FAILED|ERROR)' "$OUT/gpu_tests_gemmws.log")" "$(tail -1 "$OUT/gpu_tests_gemmws.log" 2>/dev/null)")
      ;;
    ab)
      ab=()
      for sh in ${AB_SHAPES:-24576,1536,256,128,8}; do ab+=(--shape "$sh"); done
      timeout ${AB_LIMIT_S:-300} python3 scripts/ws_ab.py --env ${AB_ENV:-SONICMOE_GLUON} --values "$AB_VALUES" \
        --rounds ${AB_ROUNDS:-7} "${ab[@]}" ${AB_ARGS:-} --json "$OUT/ab.json" > "$OUT/ab.txt" 2>&1
      SUMMARY+=("$(grep -E ' ms |Error' "$OUT/ab.txt")")
      ;;
    rules)
      # the Gluon kernels' layer rules re-checked outside their ranges with settled warm-ups (session 37 found the dH
      # rule, set from 25 ms warm-ups, too narrow): the up-projection at every d, the weight gradients at every n, the
      # dH kernel with 128-wide tiles (SONICMOE_GLUON_{UP,WGRAD,DH}=all against 1, or RULES_VALUES; RULES_ENVS picks among
      # UP WGRAD DH), RULES_ROUNDS alternating rounds
      for which in ${RULES_ENVS:-UP WGRAD}; do
        case $which in
          UP) shapes=${RULES_UP_SHAPES:-24576,1536,256,128,8 32768,2048,1024,64,8 32768,7168,2048,256,8} ;;
          WGRAD) shapes=${RULES_WGRAD_SHAPES:-24576,1536,256,128,8 40960,768,256,128,8} ;;
          DH) shapes=${RULES_DH_SHAPES:-24576,1536,128,256,16} ;;
          *) echo "RULES_ENVS: unknown $which (UP, WGRAD or DH)" >&2; exit 2 ;;
        esac
        env_name=SONICMOE_GLUON_$which
        ab=()
        for sh in $shapes; do ab+=(--shape "$sh"); done
        timeout ${RULES_LIMIT_S:-250} python3 scripts/ws_ab.py --env "$env_name" --values ${RULES_VALUES:-all,1} \
          --rounds ${RULES_ROUNDS:-5} --warmup ${RULES_WARMUP_MS:-1000} "${ab[@]}" --json "$OUT/rules_$env_name.json" \
          > "$OUT/rules_$env_name.txt" 2>&1
        SUMMARY+=("$(grep -E ' ms |Error' "$OUT/rules_$env_name.txt")")
      done
      ;;
    targets)
      for i in $(seq 1 "${TARGET_ROUNDS:-5}"); do
        for sh in ${TARGET_SHAPES:-7b=24576,1536,256,128,8 120b-n1024=32768,4096,1024,128,8}; do
          # round 1 checks both backends against the float32 reference; the 7B shape times torch in every round
          # (the 3x target is a median over rounds too)
          extra=(--no-check --backends triton); [ "${sh%%=*}" = 7b ] && extra=(--no-check --backends triton,torch)
          [ "$i" = 1 ] && extra=(--backends triton,torch)
          timeout 200 python3 -m sonicmoe bench --shape "$sh" "${extra[@]}" --no-plot --no-router-variant \
            ${TARGET_REP:+--rep $TARGET_REP} --out "$OUT/targets" --tag "round${i}_${sh%%=*}" \
            > "$OUT/targets_round${i}_${sh%%=*}.txt" 2>&1
        done
      done
      python3 scripts/target_summary.py "$OUT"/targets/*.json > "$OUT/targets_summary.txt" 2>&1
      SUMMARY+=("$(cat "$OUT/targets_summary.txt")")
      ;;
    ranks)
      # token rounding's pairs from the rank array: ranks_routing against nonzero_static (scripts/ranks_routing_probe.py;
      # RANKS_ARGS more options, e.g. --tile 64:128:4)
      timeout ${RANKS_LIMIT_S:-150} python3 scripts/ranks_routing_probe.py ${RANKS_ARGS:-} --json "$OUT/ranks_probe.json" \
        > "$OUT/ranks_probe.txt" 2>&1
      SUMMARY+=("$(cat "$OUT/ranks_probe.txt")")
      ;;
    trsync)
      timeout 400 python3 -m pytest -q -m gpu tests/test_static_routing.py tests/test_tr_scores.py tests/test_tr_select.py \
        tests/test_tr_routing.py > "$OUT/gpu_tests_trsync.log" 2>&1
      SUMMARY+=("trsync tests: $(tail -1 "$OUT/gpu_tests_trsync.log")")
      if [ -n "${TRSYNC_TESTS:-}" ]; then  # its own run: a -k there would filter the tests above too
        timeout 300 python3 -m pytest -q -m gpu ${TRSYNC_TESTS} > "$OUT/gpu_tests_trsync_more.log" 2>&1
        SUMMARY+=("more tests: $(tail -1 "$OUT/gpu_tests_trsync_more.log")")
      fi
      # TRSYNC_ARGS: more probe options (e.g. --graph)
      timeout 400 python3 scripts/tr_sync_probe.py ${TRSYNC_SHAPES:+--shape $TRSYNC_SHAPES} ${TRSYNC_ARGS:-} \
        --json "$OUT/tr_sync.json" \
        > "$OUT/tr_sync.txt" 2>&1
      SUMMARY+=("$(cat "$OUT/tr_sync.txt")")
      ;;
    trsel)
      args=()
      for sh in ${TRSEL_SHAPES:-16384,1536,512,8 16384,1536,256,8 24576,1536,128,8 16384,1536,64,8 16384,4096,256,4}; do
        args+=(--shape "$sh")
      done
      timeout 300 python3 benchmarks/tr_select_fanout.py "${args[@]}" --fanout 2 --fanout 4 --fanout 8 \
        --select-tile 2048:4 --select-tile 4096:8 --resident-warps 4 --resident-warps 8 --resident-warps 16 \
        ${TRSEL_ARGS:-} --json "$OUT/tr_select.json" > "$OUT/tr_select.txt" 2>&1
      SUMMARY+=("$(cat "$OUT/tr_select.txt")")
      ;;
    checkfx)
      # why the bench's forward reads slower right after its float32 check (session 31): the forward timed after each
      # step of the check in turn (scripts/check_effect_probe.py), on CHECKFX_SHAPES (default the 7B shape)
      for sh in ${CHECKFX_SHAPES:-24576,1536,256,128,8}; do
        timeout 200 python3 scripts/check_effect_probe.py --shape "$sh" --json "$OUT/checkfx_${sh//,/_}.json" \
          > "$OUT/checkfx_${sh//,/_}.txt" 2>&1
        SUMMARY+=("checkfx $sh" "$(cat "$OUT/checkfx_${sh//,/_}.txt")")
      done
      ;;
    ds3)
      python3 -m sonicmoe bench --shape deepseek-v3=32768,7168,2048,256,8 --backends triton --no-plot \
        --out "$OUT" --tag ds3 > "$OUT/ds3.txt" 2>&1
      SUMMARY+=("$(tail -12 "$OUT/ds3.txt")")
      ;;
    trlayer)
      timeout ${TRLAYER_LIMIT_S:-240} python3 scripts/tr_layer_profile.py ${TRLAYER_SHAPES:+--shape $TRLAYER_SHAPES} \
        > "$OUT/tr_layer_profile.txt" 2>&1
      SUMMARY+=("$(head -c 6000 "$OUT/tr_layer_profile.txt")")
      ;;
    energy)
      # joules per call of every 7B kernel, of its dense cuBLAS twin and of the whole layer under the power cap
      # (scripts/energy_probe.py; ENERGY_SHAPE T,d,n,E,K, ENERGY_ARGS more options); the table also lands in $FINAL
      timeout ${ENERGY_LIMIT_S:-300} python3 scripts/energy_probe.py ${ENERGY_SHAPE:+--shape $ENERGY_SHAPE} \
        ${ENERGY_ARGS:-} --json "$OUT/energy${ENERGY_SHAPE:+_${ENERGY_SHAPE//,/_}}.json" > "$OUT/energy.txt" 2>&1
      cp "$OUT/energy.txt" "$FINAL/energy$TAG${ENERGY_SHAPE:+_${ENERGY_SHAPE//,/_}}.txt"
      SUMMARY+=("$(grep -v Warning "$OUT/energy.txt" | tail -40)")
      ;;
    gather)
      # the gather-fused kernels gathered, on contiguous rows, MMAs alone, by TMA and against their dense twins, and
      # the weight gradients' forms (scripts/gather_path_probe.py; GATHER_SHAPES T,d,n,E,K ..., GATHER_KERNELS,
      # default up,dH,dW1,dW2,wgsplit); the tables also land in $FINAL
      for shp in ${GATHER_SHAPES:-32768,4096,1024,128,8 24576,1536,256,128,8}; do
        timeout ${GATHER_LIMIT_S:-400} python3 scripts/gather_path_probe.py --shape "$shp" \
          --kernels "${GATHER_KERNELS:-up,dH,dW1,dW2,wgsplit}" --json "$OUT/gather_${shp//,/_}.json" \
          > "$OUT/gather_${shp//,/_}.txt" 2>&1
        cp "$OUT/gather_${shp//,/_}.txt" "$FINAL/gather${TAG}_${shp//,/_}.txt"
        SUMMARY+=("$(grep -v Warning "$OUT/gather_${shp//,/_}.txt" | tail -30)")
      done
      ;;
    exposed)
      # what the exposed aggregations and the MMA warps' proxy fence cost (session 61's open items): the column-block
      # GPU test; the four gather-fused kernels with and without the fence
      # (gather_path_probe.py --kernels fence [--no-fence], fresh processes); the aggregation on reserved
      # multiprocessors in each config of reserve_probe.py (EXPOSED_RESERVES, default 8,16). About 8 minutes.
      # exposedab: fresh-process layer A/Bs of SONICMOE_AGG_RESERVE_CONFIG (EXPOSED_AB_CONFIG, default 8:1024:16:8)
      # at 120B-n1024, EXPOSED_AB_ROUNDS rounds (3). Until session 67 it also had arms for the forward's column
      # blocks, whose switch was removed then
      timeout ${EXPOSED_TEST_LIMIT_S:-240} python3 -m pytest -q -m gpu tests/test_library.py \
        -k "column_chunked_default" > "$OUT/exposed_tests.txt" 2>&1
      SUMMARY+=("$(tail -1 "$OUT/exposed_tests.txt")")
      for fence in "" --no-fence; do
        name=fence${fence:+_dropped}
        timeout 150 python3 scripts/gather_path_probe.py --kernels fence $fence --json "$OUT/$name.json" \
          > "$OUT/$name.txt" 2>&1
        SUMMARY+=("$name" "$(grep -v Warning "$OUT/$name.txt" | tail -8)")
      done
      timeout ${EXPOSED_RESERVE_LIMIT_S:-300} python3 scripts/reserve_probe.py --reserve "${EXPOSED_RESERVES:-8,16}" \
        --json "$OUT/reserve.json" > "$OUT/reserve.txt" 2>&1
      SUMMARY+=("$(grep -v Warning "$OUT/reserve.txt" | tail -40)")
      ;;
    exposedab)
      # exposed's layer A/Bs (about 2 minutes at 3 rounds)
      cfg=${EXPOSED_AB_CONFIG:-8:1024:16:8}
      AB_ARMS="base: cfg:SONICMOE_AGG_RESERVE_CONFIG=$cfg" AB_ROUNDS=${EXPOSED_AB_ROUNDS:-3} \
        AB_SHAPE=120b=32768,4096,1024,128,8 timeout ${EXPOSED_AB_LIMIT_S:-300} bash scripts/env_ab.sh "$OUT/exposed_ab" \
        > "$OUT/exposed_ab.txt" 2>&1
      SUMMARY+=("$(tail -4 "$OUT/exposed_ab/ab_summary.txt")")
      ;;
    chunkab)
      arms=""
      for w in ${CHUNK_AB_WIDTHS:-2048 1024}; do arms+="c$w:SONICMOE_AGG_CHUNK=$w "; done
      AB_ARMS="$arms" AB_ROUNDS=${CHUNK_AB_ROUNDS:-5} AB_SHAPE=120b=32768,4096,1024,128,8 \
        timeout ${CHUNK_AB_LIMIT_S:-400} bash scripts/env_ab.sh "$OUT/chunk_ab" > "$OUT/chunk_ab.txt" 2>&1
      SUMMARY+=("$(tail -3 "$OUT/chunk_ab/ab_summary.txt")")
      ;;
    ftz)
      # the SwiGLU sigmoid by the ftz forms (SONICMOE_SIGMOID_FTZ): its GPU tests, the up-projection and dH alone in
      # both forms (gather_path_probe.py --kernels ftz on FTZ_SHAPES), fresh-process layer A/Bs (FTZ_AB_SHAPES,
      # FTZ_AB_ROUNDS)
      timeout ${FTZ_TEST_LIMIT_S:-300} python3 -m pytest -q -m gpu tests/test_up_proj_ws.py tests/test_dh_ws.py \
        -k "ftz or round_pairs or test_gpu_matches_reference_and_triton" > "$OUT/ftz_tests.txt" 2>&1
      SUMMARY+=("$(tail -1 "$OUT/ftz_tests.txt")")
      for shp in ${FTZ_SHAPES:-32768,4096,1024,128,8 24576,1536,256,128,8}; do
        timeout 300 python3 scripts/gather_path_probe.py --shape "$shp" --kernels ftz \
          --json "$OUT/ftz_${shp//,/_}.json" > "$OUT/ftz_${shp//,/_}.txt" 2>&1
        SUMMARY+=("$(grep -v Warning "$OUT/ftz_${shp//,/_}.txt" | tail -6)")
      done
      for shp in ${FTZ_AB_SHAPES:-120b=32768,4096,1024,128,8 7b=24576,1536,256,128,8}; do
        AB_ARMS="off:SONICMOE_SIGMOID_FTZ=0 on:SONICMOE_SIGMOID_FTZ=1" AB_ROUNDS=${FTZ_AB_ROUNDS:-3} AB_SHAPE=$shp \
          bash scripts/env_ab.sh "$OUT/ftz_ab_${shp%%=*}" > /dev/null 2>&1
        SUMMARY+=("${shp%%=*}: $(tail -2 "$OUT/ftz_ab_${shp%%=*}/ab_summary.txt")")
      done
      ;;
    ncu)
      # Nsight Compute profiles of one expert kernel each (scripts/ncu_target.py): NCU_RUNS is a list of
      # NAME:OP:T,d,n,E,K:ROUTING[:ENV=VALUE]; each leaves NAME.ncu-rep, NAME_details.txt and NAME_raw.csv
      for r in ${NCU_RUNS:-up_topk:up:16384,1536,256,512,8:topk up_tr:up:16384,1536,256,512,8:token_rounding}; do
        IFS=: read -r name op shape routing envv <<< "$r"
        kernel=$([ "$op" = dh ] && echo '_dh_ws_kernel' || echo '_up_(ws|proj)_kernel')
        env ${envv:-} SONICMOE_AUTOTUNE=0 timeout ${NCU_LIMIT_S:-150} ncu -k "regex:$kernel" -s 2 -c 1 --set full \
          --import-source yes -f -o "$OUT/$name" python3 scripts/ncu_target.py --op "$op" --shape "$shape" \
          --routing "$routing" > "$OUT/${name}_log.txt" 2>&1
        ncu -i "$OUT/$name.ncu-rep" --page details > "$OUT/${name}_details.txt" 2>&1
        ncu -i "$OUT/$name.ncu-rep" --page raw --csv > "$OUT/${name}_raw.csv" 2>&1
        SUMMARY+=("== ncu $r" "$(grep -E '^  _|Duration|DRAM Throughput|L2 Cache Throughput|L2 Hit Rate |Compute \(SM\) Thr|Warp Cycles Per Issued' "$OUT/${name}_details.txt" | head -12)")
      done
      ;;
    profile)
      # every kernel of a 7B layer call with its in-layer time, autotuned and with the pinned configs
      timeout 200 python3 scripts/layer_profile.py > "$OUT/profile_tuned.txt" 2>&1
      SONICMOE_AUTOTUNE=0 timeout 120 python3 scripts/layer_profile.py > "$OUT/profile_pinned.txt" 2>&1
      SUMMARY+=("$(grep -hE '^==|us  x' "$OUT/profile_tuned.txt" "$OUT/profile_pinned.txt" | grep -v 'at::')")
      ;;
    tr)
      SONICMOE_AUTOTUNE=0 timeout ${TR_LIMIT_S:-300} python3 -m sonicmoe bench --preset token-rounding --backends triton \
        --no-check-grads --no-plot --out "$OUT" --tag token-rounding -q > "$OUT/tr.txt" 2>&1
      SUMMARY+=("$(tail -30 "$OUT/tr.txt")")
      ;;
    trprof)
      timeout 200 python3 -m pytest -rA tests/test_tr_select.py tests/test_tr_scores.py tests/test_token_rounding.py \
        -p no:cacheprovider \
        > "$OUT/gpu_tests_tr.log" 2>&1
      shapes=()
      for sh in ${TRPROF_SHAPES:-16384,1536,256,512,8 16384,4096,512,512,8 16384,4096,1024,256,4}; do shapes+=(--shape "$sh"); done
      SONICMOE_AUTOTUNE=0 timeout ${TRPROF_LIMIT_S:-300} python3 benchmarks/kernel_breakdown.py "${shapes[@]}" \
        --routing topk --routing token_rounding --routing-profile --json "$OUT/tr_breakdown.json" > "$OUT/tr_breakdown.txt" 2>&1
      SUMMARY+=("$(grep -E '^(FAILED|ERROR)' "$OUT/gpu_tests_tr.log")" "$(tail -1 "$OUT/gpu_tests_tr.log")"
                "$(grep -E '^shape|layer|token|router|metadata' "$OUT/tr_breakdown.txt")")
      ;;
    roofline)
      # per-kernel times against their FLOP and DRAM floors on this GPU (benchmarks/roofline.py): kernel breakdowns
      # (no layer timings) of ROOF_SHAPES under top-k and of ROOF_TR_SHAPES under top-k and token rounding, then the
      # GPU's peaks (8192^3 bf16 matmul, 2 GiB copy) measured after them
      i=0
      for sh in ${ROOF_SHAPES:-24576,1536,256,128,8 32768,4096,1024,128,8}; do
        i=$((i + 1))
        SONICMOE_AUTOTUNE=0 timeout 300 python3 benchmarks/kernel_breakdown.py --shape "$sh" --no-layer \
          --json "$OUT/roof_breakdown_$i.json" > "$OUT/roof_breakdown_$i.txt" 2>&1
      done
      for sh in ${ROOF_TR_SHAPES:-16384,1536,256,512,8 16384,4096,512,512,8 16384,4096,1024,256,4}; do
        i=$((i + 1))
        SONICMOE_AUTOTUNE=0 timeout 300 python3 benchmarks/kernel_breakdown.py --shape "$sh" --no-layer \
          --routing topk --routing token_rounding --json "$OUT/roof_breakdown_$i.json" > "$OUT/roof_breakdown_$i.txt" 2>&1
      done
      python3 benchmarks/roofline.py --measure-peaks --peaks-out "$OUT/peaks.json" --breakdown "$OUT"/roof_breakdown_*.json \
        --json "$OUT/roofline.json" --plot "$OUT/roofline.png" > "$OUT/roofline.txt" 2>&1
      SUMMARY+=("$(cat "$OUT/roofline.txt")" "$(grep -h 'speed-up' "$OUT"/roof_breakdown_*.txt)")
      ;;
    trq|train|noise)
      # trq: token-rounding quality, top-k and token rounding at E=64, K=2 on the same tokens (eval: top-k)
      q=(--experts 64 --top-k 2 --steps 400 --warmup 40 --eval-every 100 --profile-every 0)
      if [ "$step" = noise ]; then
        for s in ${TRQ_SEEDS:-0 1}; do
          train "trq_topk_s$s" "${q[@]}" --seed "$s" --routing topk &
          train "trq_tr_s$s" "${q[@]}" --seed "$s" --routing token_rounding &
        done
        train triton_s1 --steps 2000 --warmup 100 --eval-every 250 --profile-every 0 --backend triton --seed 1 &
      else
        train trq_topk "${q[@]}" --routing topk &
        train trq_tr "${q[@]}" --routing token_rounding &
      fi
      if [ "$step" = train ]; then
        # train: 2000 steps on the triton backend; the torch backend follows the same schedule (same seed,
        # same batches) for its first 1000 steps (--stop-after) to compare the curves
        t=(--steps 2000 --warmup 100 --eval-every 250 --profile-every 500)
        train triton "${t[@]}" --backend triton &
        train torch "${t[@]}" --backend torch --stop-after 1000 &
      fi
      wait
      for f in /tmp/train_*.txt; do { echo "== $f"; tail -40 "$f"; } >> "$OUT/train_stdout.txt"; done
      for f in /tmp/train_*.txt; do SUMMARY+=("$(basename "$f"): $(tail -1 "$f")"); done
      ;;
    cmp)
      # the h100 preset for 2000 steps on the triton and the torch backend at once (same seed, same data),
      # and meanwhile the GPU determinism tests (bitwise across tile configurations)
      t=(--steps 2000 --warmup 100 --eval-every 250 --profile-every 0)
      train triton "${t[@]}" --backend triton &
      train torch "${t[@]}" --backend torch &
      if [ "${CMP_TRACE:-0}" = 1 ]; then  # the launch traces too (float32, bfloat16), in the background
        for dt in float32 bfloat16; do trace $dt 240 & done
      fi
      # shellcheck disable=SC2086
      timeout "${CMP_TESTS_LIMIT_S:-150}" python3 -m pytest -rA -m gpu ${CMP_TESTS:-tests/test_kernels.py -k "bitwise or tma_configs"} \
        -p no:cacheprovider > "$OUT/gpu_tests_det.log" 2>&1
      wait
      for f in /tmp/train_*.txt; do { echo "== $f"; tail -40 "$f"; } >> "$OUT/train_stdout.txt"; done
      SUMMARY+=("$(grep -E '^(FAILED|ERROR|PASSED)' "$OUT/gpu_tests_det.log")" "$(tail -1 "$OUT/gpu_tests_det.log")")
      for f in /tmp/train_*.txt; do SUMMARY+=("$(basename "$f"): $(tail -1 "$f")"); done
      for f in "$OUT"/trace_*.txt; do [ -f "$f" ] && SUMMARY+=("$(basename "$f"): $(tail -2 "$f" | tr '\n' ' ')"); done
      ;;
    trace)
      # every Triton launch of one training step logged and synchronised (float32, bfloat16): names a kernel that hangs
      for dt in float32 bfloat16; do
        trace $dt 150
        SUMMARY+=("trace $dt: rc $? $(tail -2 "$OUT/trace_$dt.txt" | tr '\n' ' ')")
      done
      ;;
    full|granularity|models)
      # BENCH_LIMIT_S: a time limit per preset run; the results file is rewritten after every shape, so a run
      # cut short leaves the shapes it finished
      if [ "$step" != models ]; then
        timeout "${BENCH_LIMIT_S:-3000}" python3 -m sonicmoe bench --preset ${GRAN_PRESETS:-granularity,iso-flops} \
          --backends "${FULL_BACKENDS:-triton,torch}" --no-router-variant --no-plot --out "$OUT" --tag granularity \
          > "$OUT/bench.txt" 2>&1
        SUMMARY+=("$(tail -30 "$OUT/bench.txt")")
      fi
      if [ "$step" != granularity ]; then
        timeout "${BENCH_LIMIT_S:-3000}" python3 -m sonicmoe bench --preset models \
          --backends "${FULL_BACKENDS:-triton,torch}" --no-router-variant --no-plot --out "$OUT" --tag models \
          > "$OUT/bench_models.txt" 2>&1
        SUMMARY+=("$(tail -12 "$OUT/bench_models.txt")")
      fi
      ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
echo "=== summary"
printf '%s\n' "${SUMMARY[@]}" | tee "$FINAL/summary$TAG.txt"
