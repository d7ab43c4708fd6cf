"""``tilefuse bench mla --quick`` restricted to its 16-bit dense cases (the per-layer headline's
29 cases and the three page sizes; no FP8-cache or sparse case), written as the family's result
file like the CLI writes it (``bench/results/mla-<gpu>-quick-<tag>.json`` + PNG, the rows saved
after every case). ``--only`` cannot pick these: every case's params hold ``"dtype": "bfloat16"``.

    python3 tools/mla_perlayer_bench.py [--out DIR] [--tag perlayer] [--rep-ms 10] [--eager-ms 20] [--lean]
                                        [--warm] [--first N] [--few-rows-first]

``--warm`` calls each case's tilefuse implementations once, untimed, and writes nothing: run
beside a build of the FlashMLA peers, it fills Triton's cache so that the timed run spends its
time timing. ``--first N``: the first N cases only; ``--few-rows-first``: the cases
of at most 32 query rows first (a time-boxed A/B of the transposed form). ``--lean`` leaves out the implementations the
per-layer headline does not read (the ``tl`` kernels forced, ``tilefuse:transposed`` and
``tilefuse:standard``, and ``torch_naive``), so that a time-boxed run covers more cases. FlashMLA builds come from
``TILEFUSE_FLASHMLA`` as in the CLI.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from tilefuse.bench import mla, runner
from tilefuse.bench.harness import Timer, measure_ceilings


def dense_cases(device: torch.device) -> list:
    """The quick grid's dense 16-bit cases, in the benchmark's order."""
    return [c for c in mla.cases(device, quick=True) if "kv" not in c.params and "topk" not in c.params]


LEAN_DROPS = ("tilefuse:transposed", "tilefuse:standard", "torch_naive")


def lean(case):
    """``case`` without the implementations of :data:`LEAN_DROPS`."""
    setup = case.setup

    def lean_setup():
        return {name: fn for name, fn in setup().items() if name not in LEAN_DROPS}
    case.setup = lean_setup
    return case


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--tag", default="perlayer")
    ap.add_argument("--rep-ms", type=float, default=10.0)
    ap.add_argument("--eager-ms", type=float, default=runner.EAGER_LOOP_MS)
    ap.add_argument("--lean", action="store_true")
    ap.add_argument("--warm", action="store_true")
    ap.add_argument("--first", type=int, default=None)
    ap.add_argument("--few-rows-first", action="store_true",
                    help="the cases of <= 32 query rows first (where the Gluon kernel's transposed form applies)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    cases = dense_cases(device)
    if args.few_rows_first:
        cases.sort(key=lambda c: c.params["h_q"] * c.params["s_q"] > 32)
    cases = cases[: args.first]
    if args.lean:
        cases = [lean(case) for case in cases]
    if args.warm:
        for i, case in enumerate(cases, 1):
            try:
                impls = case.setup()
                for name, fn in impls.items():
                    if name.startswith("tilefuse"):
                        fn()
                torch.cuda.synchronize()
            except Exception as exc:      # a case that cannot be built here: the timed run records it
                print(f"[warm {i}] {case.params}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
            print(f"[warm {i}/{len(cases)}] {case.params}", file=sys.stderr, flush=True)
            del case
            mla.clear_cache()
            torch.cuda.empty_cache()
        return 0
    ceilings = measure_ceilings(device, quick=True)
    timer = Timer(device, rep_ms=args.rep_ms, eager_ms=args.eager_ms)
    head = runner.header(device, ceilings, timer)
    print(f"machine: {head['machine']}; ceilings {ceilings}", file=sys.stderr, flush=True)

    def save(rows):
        runner.write_results("mla", rows, head, args.out, quick=True, tag=args.tag)

    rows = runner.run_family("mla", cases, timer, ceilings, progress=save)
    summary = mla.summarize(rows)
    path = runner.write_results("mla", rows, head, args.out, summary, quick=True, tag=args.tag)
    runner.print_summary("mla", summary)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
