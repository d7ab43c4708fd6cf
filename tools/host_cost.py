"""Host cost of one eager call of each op, against the PyTorch call it replaces, and where it goes.

    python3 tools/host_cost.py [OUT_DIR] [--calls 2000]     # -> OUT_DIR/host-cost-<gpu>.json

Eager decode is host-bound (``tools/eager_profile.py``: on an H200 a Llama-3-8B-shaped block
spends about a tenth of its step on the GPU), so an op's Python and launch cost is what a user of
eager ``generate`` pays. Per op, at a decode size (one token; the shapes of Llama-3-8B's MLP):

* ``us_per_call``: wall time of ``--calls`` back-to-back calls over their count, with no
  synchronization inside the loop (the GPU runs behind: each call is far shorter on the GPU than
  on the host), after a warm-up that compiled and planned everything;
* the PyTorch baseline's the same way (``F.linear`` for a linear layer, ``nn.Linear`` for a
  ``VQLinear``, whose calls after the first take its bound launch; the two linears, SiLU
  and mul for the SwiGLU gate/up projection; ``torch._scaled_mm`` row-wise, SiLU and mul for the
  FP8 one, whose own call also re-quantizes its output to e4m3);
* MLA decode's metadata and attention calls at a short step (the attention's baseline: itself
  with the combine launched without PDL);
* ``top``: the functions with the most own time in ``cProfile`` over the same calls, which names
  the Python that costs.

Needs a CUDA GPU.
"""

from __future__ import annotations

import cProfile
import pstats
import time

from sweep_common import parse_args, sweep_path, write_json

TOP = 12


def per_call_us(fn, calls: int) -> float:
    import torch

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def top_functions(fn, calls: int) -> list[dict]:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:TOP]   # by own (total internal) time
    return [{"function": f"{path.split('site-packages/')[-1].split('tilefuse/')[-1]}:{line} {name}",
             "own_us_per_call": round(tt / calls * 1e6, 2), "calls_per_call": round(nc / calls, 2)}
            for (path, line, name), (cc, nc, tt, ct, callers) in rows]


def main() -> None:
    args = parse_args(__doc__, configs=False, workers=False,
                      **{"--calls": dict(type=int, default=2000, help="calls per timing (default 2000)")})
    import torch
    import torch.nn.functional as F

    import tilefuse
    from tilefuse.nn import VQLinear
    from tilefuse.ops.swiglu_fp8.reference import FP8
    from tilefuse.testing.swiglu import make_fp8_case
    from tilefuse.testing.vq import make_weight

    device = torch.device("cuda")
    torch.manual_seed(0)
    h, i = 4096, 14336
    x = torch.randn(1, h, device=device, dtype=torch.bfloat16)
    w_gate, w_up = (torch.randn(i, h, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(2))
    w = torch.cat([w_gate, w_up])
    x16 = x.half()
    codes, codebooks, scales = make_weight(h, h, torch.float16, device, codes_dtype=torch.int8)
    w_dense = torch.randn(h, h, device=device, dtype=torch.float16) * 0.02
    vq_layer = VQLinear(h, h, bias=False, dtype=torch.float16, device=device).load_quantized(codes, codebooks, scales)
    dense_layer = torch.nn.Linear(h, h, bias=False, device=device, dtype=torch.float16)
    fp8 = make_fp8_case(1, h, i, device, x_scaling="token", w_scaling="channel")
    x8, xs, w8, ws = fp8.args()
    ws_row = ws.reshape(1, -1)

    def scaled_mm_silu():
        y = torch._scaled_mm(x8, w8.T, scale_a=xs, scale_b=ws_row, out_dtype=torch.bfloat16)
        return F.silu(y[:, :i]) * y[:, i:]

    ops = {
        "swiglu": (lambda: tilefuse.swiglu(x, w), lambda: F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)),
        "swiglu_fp8": (lambda: tilefuse.swiglu_fp8(x8, xs, w8, ws, out_dtype=FP8), scaled_mm_silu),
        "vq_matmul": (lambda: tilefuse.vq_matmul(x16, codes, codebooks, scales), lambda: F.linear(x16, w_dense)),
        "VQLinear": (lambda: vq_layer(x16), lambda: dense_layer(x16)),      # the bound launch vs nn.Linear
    }
    rows = []
    for name, (ours, theirs) in ops.items():
        with torch.no_grad():
            row = {"op": name, "us_per_call": round(per_call_us(ours, args.calls), 2),
                   "baseline_us_per_call": round(per_call_us(theirs, args.calls), 2),
                   "top": top_functions(ours, args.calls // 4)}
        print(f"{name}: {row['us_per_call']} us per eager call, PyTorch baseline {row['baseline_us_per_call']}",
              flush=True)
        for entry in row["top"][:6]:
            print("   ", entry, flush=True)
        rows.append(row)
    rows += _mla_rows(args.calls)
    write_json(sweep_path("host-cost", args.out_dir), {"what": __doc__.split("\n\n")[0], "calls": args.calls,
                                                       "rows": rows})


def _mla_rows(calls: int) -> list[dict]:
    """MLA decode's two eager calls at a short decode step (16 requests of 4096 tokens, 16 heads):
    the metadata and one attention call (the shipped levers; the baseline: the same call with the
    combine launched without PDL, which a launch with launch attributes could make dearer)."""
    import torch

    import tilefuse
    from tilefuse.ops.mla import configs
    from tilefuse.testing.mla import make_case

    inp = make_case([4096] * 16, 1, 16, torch.bfloat16, torch.device("cuda"))
    meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, 16, 1)

    def attention():
        return tilefuse.flash_mla_with_kvcache(*inp.args(), 512, meta, splits, causal=True)

    def metadata():
        return tilefuse.get_mla_metadata(inp.cache_seqlens, 16, 1)

    rows = []
    with torch.no_grad():
        with configs.wgmma_levers(PDL=0):
            plain = round(per_call_us(attention, calls), 2)
        for name, fn, baseline in (("mla_attention", attention, plain), ("mla_metadata", metadata, None)):
            row = {"op": name, "us_per_call": round(per_call_us(fn, calls), 2), "baseline_us_per_call": baseline,
                   "top": top_functions(fn, calls // 4)}
            print(f"{name}: {row['us_per_call']} us per eager call"
                  + (f", without PDL {baseline}" if baseline else ""), flush=True)
            for entry in row["top"][:8]:
                print("   ", entry, flush=True)
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
