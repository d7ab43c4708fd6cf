"""Judge the SwiGLU dispatch against a `tilefuse tune` table measured elsewhere: for every (H, I, M)
of the table, the path the shipped dispatch takes (``configs.decide``, the table itself not
loaded), its measured time, and that time over the unfused path's and over the best candidate's.

    tilefuse tune --model-type phi4-14b --tp 1,2 --out OUT/heldout.json      # on the GPU
    python3 tools/dispatch_check.py OUT/heldout.json [--json OUT/check.json]

Run it on models the dispatch was not fitted on (``tilefuse.testing.corpus.HELD_OUT``): it says
whether the rules generalize. A pick whose config the tune run did not time is reported as such
(its ratio is not invented). Prints a line per case, then the worst and the geomean ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def check(table: dict) -> dict:
    """``{"cases": [...], "worst_over_unfused", "geomean_over_unfused", "geomean_over_best",
    "unmeasured"}`` for a tune file's ``{"tuned": {"swiglu": {"H,I": {"M": entry}}}}``."""
    from tilefuse.ops.swiglu import configs
    from tilefuse.tune import _label

    cases, unmeasured = [], 0
    for shape, per_m in table["tuned"]["swiglu"].items():
        h, i = (int(v) for v in shape.split(","))
        for m, entry in sorted(per_m.items(), key=lambda kv: int(kv[0])):
            times = {k: v for k, v in entry.get("us", {}).items() if v}
            if "unfused" not in times:
                continue
            choice = configs.decision(int(m), h, i)
            label = _label(choice.variant, choice.config)
            mine = times.get(label)
            row = {"H": h, "I": i, "M": int(m), "pick": choice.variant, "source": choice.source,
                   "pick_us": mine, "unfused_us": times["unfused"], "best_us": min(times.values())}
            if mine is None:
                unmeasured += 1
            else:
                row["over_unfused"] = mine / times["unfused"]
                row["over_best"] = mine / row["best_us"]
            cases.append(row)
    ratios = [c["over_unfused"] for c in cases if "over_unfused" in c]
    best = [c["over_best"] for c in cases if "over_best" in c]

    def geomean(values):
        return math.exp(sum(map(math.log, values)) / len(values)) if values else None

    return {"cases": cases, "worst_over_unfused": max(ratios, default=None),
            "geomean_over_unfused": geomean(ratios), "geomean_over_best": geomean(best), "unmeasured": unmeasured}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("table", type=Path, help="a tilefuse tune output file")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    result = check(json.loads(args.table.read_text()))
    for c in result["cases"]:
        ratio = f"{c['over_unfused']:.3f} of unfused, {c['over_best']:.3f} of best" if "over_unfused" in c \
            else "pick not timed by the tune run"
        print(f"{c['H']}x{c['I']} M={c['M']:<6} {c['pick']:<9} ({c['source']}): {ratio}")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    print(f"worst over unfused {fmt(result['worst_over_unfused'])}, geomean over unfused "
          f"{fmt(result['geomean_over_unfused'])}, geomean over best {fmt(result['geomean_over_best'])}, "
          f"{result['unmeasured']} picks not timed", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
