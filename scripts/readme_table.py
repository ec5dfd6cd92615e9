#!/usr/bin/env python
"""Print the README markdown table of a ``sonicmoe bench`` results file.

Usage: ``python scripts/readme_table.py benchmarks/results/<date>_<gpu>.json [more.json ...]``
(the same as ``sonicmoe bench --markdown-from FILE.json``).
"""

from __future__ import annotations

import sys

from sonicmoe.bench.report import load_results, markdown_table


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    for i, path in enumerate(argv):
        if i:
            print()
        print(markdown_table(load_results(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
