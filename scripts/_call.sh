#!/bin/bash
export PYTHONPATH=$PWD SONICMOE_GIT_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo na)
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > $OUT/env.txt
timeout 90 python -m pytest -q -x tests/test_dh_ws.py -m gpu -k "split_epilogue" > $OUT/tests.txt 2>&1; tail -3 $OUT/tests.txt
timeout 100 python scripts/gather_path_probe.py --kernels split --json $OUT/split120.json 2>&1 | tee $OUT/split120.txt | grep -v "^\s*$" | tail -6
timeout 60 python scripts/gather_path_probe.py --kernels split --shape 24576,1536,256,128,8 --json $OUT/split7b.json 2>&1 | tee $OUT/split7b.txt | grep -v "^\s*$" | tail -6
AB_ARMS="base:SONICMOE_DH_SPLIT=0 split:SONICMOE_DH_SPLIT=1" AB_ROUNDS=2 AB_SHAPE=120b=32768,4096,1024,128,8 timeout 120 bash scripts/env_ab.sh $OUT/ab > /dev/null 2>&1
cat $OUT/ab/ab_summary.txt; tar czf $OUT/ab.tgz -C $OUT ab && rm -rf $OUT/ab
