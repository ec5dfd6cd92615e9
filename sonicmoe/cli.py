"""``sonicmoe`` command line: ``sonicmoe train ...`` (the main job) and ``sonicmoe bench ...``."""

from __future__ import annotations

import sys

USAGE = """usage: sonicmoe {train,bench} [options]

  train   train a small MoE language model on real text (default: the CPython stdlib sources)
  bench   time our MoE layer against the torch backend and the cuBLAS upper bound

Run 'sonicmoe train --help' or 'sonicmoe bench --help' for the options."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        from .train.cli import main as run
    elif cmd == "bench":
        from .bench.cli import main as run
    else:
        print(f"sonicmoe: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return int(run(rest) or 0)


if __name__ == "__main__":  # python -m sonicmoe.cli, as python -m sonicmoe
    sys.exit(main())
