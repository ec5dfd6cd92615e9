"""Loss curves of several `sonicmoe train` runs on one figure, from their committed log.json files.

usage: python benchmarks/plot_train.py OUT.png LABEL=RUN/log.json [LABEL=RUN/log.json ...] [--ylim LO,HI]
(e.g. the triton and torch backends on the same seed and data, or top-k against token rounding).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sonicmoe.train.report import plot_runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("runs", nargs="+", metavar="LABEL=LOG.json")
    ap.add_argument("--title", default=None)
    ap.add_argument("--ylim", default=None, metavar="LO,HI", help="the loss axis' range (a negative LO: --ylim=LO,HI)")
    args = ap.parse_args()
    ylim = None
    if args.ylim is not None:
        try:
            lo, hi = (float(v) for v in args.ylim.split(","))
        except ValueError:
            ap.error(f"--ylim {args.ylim}: expected LO,HI (two numbers)")
        if not lo < hi:
            ap.error(f"--ylim {args.ylim}: LO must be below HI")
        ylim = (lo, hi)
    if not Path(args.out).resolve().parent.is_dir():
        ap.error(f"{args.out}: its folder does not exist")
    runs, parts = [], []
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            ap.error(f"{spec!r}: expected LABEL=RUN/log.json")
        try:
            log = json.loads(Path(path).read_text())
            runs.append((label, log["steps"], log["evals"]))
            cfg, env = log["config"], log["env"]
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            ap.error(f"{path}: not a sonicmoe train log.json ({type(e).__name__}: {e})")
        parts.append(f"{label}: {log['steps_done']} steps")
    title = args.title or (f"{env['device_name']} | d={cfg['d_model']} E={cfg['experts']} K={cfg['top_k']} "
                           f"n={cfg['expert_size']} | " + ", ".join(parts))
    plot_runs(Path(args.out), runs, title, ylim=ylim)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
