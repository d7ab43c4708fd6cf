"""Graph-replay times of one MLA decode kernel, forced, on a few cases: an A/B of a kernel change
runs it once per version of the kernel in the same device call (the version swapped in between).

    python3 tools/mla_graph_times.py LABEL [--variant wgmma] > times.jsonl

Prints one JSON line: ``{"label", "variant", "us": {case: median us}}``; each case's time is the
middle of three medians of ``triton.testing.do_bench`` over a captured decode step (bf16, s_q 1,
equal lengths; cases ``b<batch>-l<length>-h<heads>``).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

import tilefuse
from tilefuse.testing.mla import make_case

CASES = ((64, 4096, 128), (132, 8192, 128), (128, 4096, 16), (16, 32768, 128))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("label")
    ap.add_argument("--variant", default="wgmma")
    args = ap.parse_args()
    times = {}
    for batch, length, h_q in CASES:
        case = make_case([length] * batch, 1, h_q, torch.bfloat16, "cuda")
        with tilefuse.force(variant=args.variant):
            meta, splits = tilefuse.get_mla_metadata(case.cache_seqlens, h_q, 1)

            def step():
                return tilefuse.flash_mla_with_kvcache(*case.args(), 512, meta, splits, causal=False)
            step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            medians = sorted(triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
                             for _ in range(3))
        times[f"b{batch}-l{length}-h{h_q}"] = round(medians[1] * 1000, 2)
    print(json.dumps({"label": args.label, "variant": args.variant, "us": times}), flush=True)


if __name__ == "__main__":
    main()
