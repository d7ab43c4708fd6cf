"""Recompute the summary of benchmark results files from their rows and redraw their plots.

    python3 tools/replot.py bench/results/swiglu-h200.json [more.json ...]

For each file: the family's ``summarize`` runs on the file's rows (rows of the older schema too:
``median_us`` is read as ``gpu_us``, rates come from ``graph_us`` alone, no ``eager_us`` is made
up; see ``tilefuse.bench.harness.upgrade_rows``), the ``summary`` is written back into the file,
the PNG beside it is redrawn and the goals table is printed. The rows are not changed. A file
that cannot be resummarized (a CPU pipeline check: nothing was timed) is named on stderr and
skipped; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tilefuse.bench.runner import print_summary, resummarize


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, help="results files (<family>-<gpu>[...].json)")
    status = 0
    for path in parser.parse_args(argv).paths:
        try:
            family, summary = resummarize(path)
        except ValueError as exc:
            print(f"tools/replot.py: {exc}", file=sys.stderr)
            status = 1
            continue
        print_summary(family, summary)
        print(f"rewrote the summary of {path} and drew {path.with_suffix('.png')}", file=sys.stderr)
    return status


if __name__ == "__main__":
    from tilefuse.cli import ClosedPipeSafe

    sys.stdout = ClosedPipeSafe(sys.stdout)     # `tools/replot.py ... | head` ends quietly
    sys.exit(main())
