"""Compare two `sonicmoe train` logs of the same options: one process against a data-parallel run (torchrun).

usage: python scripts/dp_compare.py ONE/log.json MANY/log.json
Prints the ranks, tokens/s of each, the largest relative gap of the training losses step by step and of the
validation losses, and the final losses.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("one")
    p.add_argument("many")
    args = p.parse_args()
    one, many = (json.load(open(f)) for f in (args.one, args.many))
    gap = max(abs(a["loss"] / b["loss"] - 1) for a, b in zip(many["steps"], one["steps"], strict=True))
    vgap = max(abs(a["val_loss"] / b["val_loss"] - 1) for a, b in zip(many["evals"], one["evals"], strict=True))
    dp = many["data_parallel"]
    print(f"data-parallel {dp['world_size']} ranks ({dp['backend']}) against one process, {len(one['steps'])} steps: "
          f"tokens/s {many['tokens_per_s']:,.0f} against {one['tokens_per_s']:,.0f}; largest relative gap of the "
          f"training losses {gap:.2e}, of the validation losses {vgap:.2e}; final val loss "
          f"{many['final_val_loss']:.4f} against {one['final_val_loss']:.4f}")


if __name__ == "__main__":
    main()
