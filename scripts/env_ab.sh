#!/usr/bin/env bash
# Layer A/B of environment settings in one source tree (the working tree): each arm a set of environment variables
# (the SONICMOE_* switches of the README's table), each run a fresh process of `python -m sonicmoe bench` on one
# shape (triton backend, no check, no plot); the arms' order rotates from round to round so that a drift of the
# machine's clock over the call falls on every arm alike. scripts/tree_ab.sh compares two source trees instead.
# usage (device, repo root):
#   AB_ARMS="auto: cfg2:SONICMOE_VARLEN_M_CONFIG=2 dh:SONICMOE_DH_STAGE_IN_RING=0,SONICMOE_OVERLAP=1" \
#   AB_ROUNDS=4 AB_SHAPE=120b=32768,4096,1024,128,8 [AB_REP=1000] bash scripts/env_ab.sh OUTDIR
# (arms separated by spaces, each NAME:VAR=VALUE,VAR=VALUE; "NAME:" runs with no extra variable.)
# Writes OUTDIR/<tag>.json per run and OUTDIR/ab_summary.txt (one line per run, then each arm's medians).
set -uo pipefail
out=${1:?usage: env_ab.sh OUTDIR}
rounds=${AB_ROUNDS:-4}
shape=${AB_SHAPE:-7b=24576,1536,256,128,8}
read -r -a arms <<< "${AB_ARMS:?set AB_ARMS, e.g. 'auto: cfg2:SONICMOE_VARLEN_M_CONFIG=2'}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
summary="$out/ab_summary.txt"
: > "$summary"
n=${#arms[@]}
for r in $(seq 1 "$rounds"); do
  for i in $(seq 0 $((n - 1))); do
    arm=${arms[$(( (i + r - 1) % n ))]}
    name=${arm%%:*}
    settings=${arm#*:}
    start=$(date +%s)
    line=$(env ${settings//,/ } python -m sonicmoe bench --shape "$shape" --backends triton --no-check --no-plot \
      --no-router-variant --rep "${AB_REP:-1000}" --out "$out" --tag "r$r-$name" 2>&1 | grep -m1 "triton: ")
    echo "r$r $name [${settings}] $line ($(( $(date +%s) - start )) s)" | tee -a "$summary"
  done
done
python - "$summary" <<'EOF' | tee -a "$summary"
import collections, re, statistics, sys
runs = collections.defaultdict(lambda: {"fwd": [], "tot": []})
for line in open(sys.argv[1]):
    m = re.match(r"r\d+ (\S+) .*fwd ([\d.]+) ms, fwd\+bwd ([\d.]+) ms", line)
    if m:
        runs[m[1]]["fwd"].append(float(m[2]))
        runs[m[1]]["tot"].append(float(m[3]))
for name, t in runs.items():
    print(f"{name}: median fwd {statistics.median(t['fwd']):.4f} ms, fwd+bwd {statistics.median(t['tot']):.4f} ms "
          f"({len(t['tot'])} runs; fwd+bwd {min(t['tot']):.3f}-{max(t['tot']):.3f})")
EOF
