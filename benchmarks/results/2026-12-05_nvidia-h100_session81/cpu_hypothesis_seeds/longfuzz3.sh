#!/bin/bash
# usage: longfuzz2.sh CORE FIRST LAST
cd /work/main
for s in $(seq $2 $3); do
  for t in "tests/test_fuzz.py::test_fuzz_triton_vs_reference_float32" tests/test_routing.py tests/test_static_routing.py tests/test_token_rounding.py tests/test_topk_routing.py tests/test_tr_routing.py tests/test_layer_fuzz.py tests/test_load_order.py; do
    out=$(taskset -c $1 timeout 900 python -m pytest -q -x -p no:cacheprovider -W ignore --hypothesis-seed=$s "$t" -k "fuzz or hyp or given or random or property or float32 or vs" 2>&1 | tail -60)
    if echo "$out" | tail -1 | grep -q failed; then echo "=== FAIL seed $s $t"; echo "$out" | grep -v "TypedDict\|^  /root"; fi
  done
  echo "seed $s done $(date +%T)"
done
