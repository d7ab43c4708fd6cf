"""Wrong outputs of CUDA graphs that run cuBLAS, captured on torch.cuda.graph's shared capture
stream and replayed at once on two streams, with and without ``tilefuse._scratch.blas``.

Runs ``tests/test_concurrency.py``'s ``graph_race`` for every tilefuse path that calls cuBLAS
(and plain ``F.linear``) on two pairings of shapes, first with ``_scratch.blas`` replaced by a
plain call (the code before the fix), then as it is; writes the counts to a JSON file.

    python tools/swiglu_graph_race.py bench/results/sweeps/swiglu-graph-race-<gpu>.json
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path[:0] = [os.path.join(os.path.dirname(__file__), ".."), os.path.join(os.path.dirname(__file__), "..", "tests")]

import tilefuse  # noqa: E402
from tilefuse import _scratch  # noqa: E402
from test_concurrency import BLAS_SHAPES, blas_paths, graph_race  # noqa: E402


def main(path: str) -> None:
    fixed = _scratch.blas
    pairs = {"x[4,8192] I=1024 + x[4,16384] I=512": BLAS_SHAPES, "x[4,16384] I=512 twice": BLAS_SHAPES[1:] * 2}
    rows = []
    for mode in ("before (plain cuBLAS call)", "after (_scratch.blas)"):
        _scratch.blas = fixed if mode.startswith("after") else (lambda fn, *a, **k: fn(*a, **k))
        for name, build in blas_paths().items():
            for pair_name, pair in pairs.items():
                torch.manual_seed(0)
                choice = tilefuse.explain(tilefuse.swiglu, *build_args(pair[0])) if name == "swiglu default" else None
                wrong, total = graph_race(build, pair)
                rows.append({"mode": mode, "path": name, "shapes": pair_name, "wrong": wrong, "outputs": total,
                             **({"default_pick": choice.variant} if choice is not None else {})})
                print(rows[-1], flush=True)
    _scratch.blas = fixed
    result = {"what": "wrong outputs (max abs error > 1e-2 x max abs of the eager result) of two CUDA graphs "
                      "captured on torch.cuda.graph's default capture stream and replayed at once on two "
                      "streams, 400 replays each, M = 4, bf16 (fp32 for the reference path)",
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d", time.gmtime()),
              "script": "tools/swiglu_graph_race.py", "rows": rows}
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def build_args(shape):
    h, i = shape
    return (torch.empty(4, h, dtype=torch.bfloat16, device="cuda"),
            torch.empty(2 * i, h, dtype=torch.bfloat16, device="cuda"))


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0] + " (needs a CUDA GPU)")
    cli.add_argument("out", help="JSON file to write, e.g. bench/results/sweeps/swiglu-graph-race-h100.json")
    args = cli.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tools/swiglu_graph_race.py: needs a CUDA GPU; torch sees none here")
    main(args.out)
