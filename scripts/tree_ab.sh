#!/usr/bin/env bash
# Layer A/B of two source trees on one GPU: the working tree ("new") against an older tree's sonicmoe/ unpacked in
# _base/ ("base"; e.g. `git archive REV sonicmoe | tar -x -C _base`; git ignores it, so name it in the device call's
# carry list), each run a fresh process of `python -m sonicmoe bench` on one shape (triton backend, no check, no
# plot), rounds in ABBA order so that a drift of the machine's clock over the call falls on both trees alike.
# usage (device, repo root): AB_ROUNDS=6 AB_SHAPE=7b=24576,1536,256,128,8 [AB_REP=1000] bash scripts/tree_ab.sh OUTDIR
# Writes OUTDIR/<tag>.json per run and OUTDIR/ab_summary.txt (one line per run, then the medians).
set -uo pipefail
out=${1:?usage: tree_ab.sh OUTDIR}
rounds=${AB_ROUNDS:-6}
shape=${AB_SHAPE:-7b=24576,1536,256,128,8}
mkdir -p "$out"
[ -d _base/sonicmoe ] || { echo "no _base/sonicmoe: unpack the base tree there first" >&2; exit 2; }
summary="$out/ab_summary.txt"
: > "$summary"
out=$(cd "$out" && pwd)
# `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH: each tree's runs start in its own
# root (until session 50 both arms ran from the repo root, so "base" imported the working tree too)
for tree in base new; do
  root=$PWD; [ "$tree" = base ] && root=$PWD/_base
  where=$(cd "$root" && python -c "import os, sonicmoe; print(os.path.dirname(sonicmoe.__file__))")
  echo "$tree imports sonicmoe from $where" | tee -a "$summary"
  [ "$where" = "$root/sonicmoe" ] || { echo "the $tree tree's runs would not import its own sonicmoe" >&2; exit 2; }
done
for r in $(seq 1 "$rounds"); do
  if (( r % 2 )); then order="base new"; else order="new base"; fi
  for tree in $order; do
    root=$PWD; [ "$tree" = base ] && root=$PWD/_base
    start=$(date +%s)
    line=$(cd "$root" && python -m sonicmoe bench --shape "$shape" --backends triton --no-check --no-plot \
      --no-router-variant --rep "${AB_REP:-1000}" --out "$out" --tag "r$r-$tree" 2>&1 | grep -m1 "triton: ")
    echo "r$r $tree $line ($(( $(date +%s) - start )) s)" | tee -a "$summary"
  done
done
python - "$summary" <<'EOF' | tee -a "$summary"
import re, statistics, sys
runs = {"base": {"fwd": [], "tot": []}, "new": {"fwd": [], "tot": []}}
for line in open(sys.argv[1]):
    m = re.match(r"r\d+ (base|new) .*fwd ([\d.]+) ms, fwd\+bwd ([\d.]+) ms", line)
    if m:
        runs[m[1]]["fwd"].append(float(m[2]))
        runs[m[1]]["tot"].append(float(m[3]))
for key in ("fwd", "tot"):
    b, n = runs["base"][key], runs["new"][key]
    if b and n:
        wins = sum(x < y for x, y in zip(n, b))
        print(f"median {key} ms: base {statistics.median(b):.4f}, new {statistics.median(n):.4f} "
              f"(new faster in {wins} of {min(len(b), len(n))} rounds)")
EOF
