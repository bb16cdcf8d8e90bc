"""Rewrite a page's benchmark table from a committed results.json (no figure is typed by hand).

Replaces what lies between the markers ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` in the page (``--marker
NAME``, default ``bench``) with the table :func:`speculant.bench.report.readme_section` renders from the results; everything outside the markers is
left byte for byte. ``make bench`` writes the results, ``make bench-readme`` runs this script.

    python benchmarks/readme_table.py [--results benchmarks/results/bench/results.json] [--readme docs/results/bundled-pair.md]
    python benchmarks/readme_table.py --results benchmarks/results/mtbench-80-fp32/results.json --marker mtbench-fp32 \
        --readme docs/results/smollm2-mtbench.md
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from speculant.bench.report import readme_section

ROOT = Path(__file__).resolve().parent.parent


def rewrite(text: str, block: str, marker: str = "bench") -> str:
    """``text`` with the lines between the ``marker``'s start and end comments replaced by ``block``."""
    START, END = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"  # noqa: N806
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(f"the README needs exactly one {START} followed by one {END}")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{block.strip()}\n{END}{tail}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks/results/bench/results.json")
    ap.add_argument("--readme", type=Path, default=ROOT / "docs/results/bundled-pair.md")
    ap.add_argument("--marker", default="bench", help="the block to rewrite (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        results = json.loads(args.results.read_text(encoding="utf-8"))
        try:
            source = args.results.resolve().relative_to(ROOT).as_posix()
        except ValueError:
            source = str(args.results)
        text = args.readme.read_text(encoding="utf-8")
        new = rewrite(text, readme_section(results, source=source), args.marker)
    except (OSError, ValueError, KeyError) as exc:
        print(f"readme_table: error: {exc}", file=sys.stderr)
        return 2
    if new != text:
        args.readme.write_text(new, encoding="utf-8")
    print(f"{args.readme}: benchmark table {'updated' if new != text else 'already up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
