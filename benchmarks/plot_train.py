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
        ylim = (lo, hi)
    runs, parts = [], []
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            ap.error(f"{spec!r}: expected LABEL=RUN/log.json")
        log = json.loads(Path(path).read_text())
        runs.append((label, log["steps"], log["evals"]))
        cfg, env = log["config"], log["env"]
        parts.append(f"{label}: {log['steps_done']} steps")
    title = args.title or (f"{env['device_name']} | d={cfg['d_model']} E={cfg['experts']} K={cfg['top_k']} "
                           f"n={cfg['expert_size']} | " + ", ".join(parts))
    plot_runs(Path(args.out), runs, title, ylim=ylim)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
