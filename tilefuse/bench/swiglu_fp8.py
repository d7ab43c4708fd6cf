"""``tilefuse bench swiglu_fp8``: the FP8 fused SwiGLU against cuBLASLt's ``torch._scaled_mm``.

Per case (model shape x M; e4m3 inputs from :func:`tilefuse.testing.swiglu.make_fp8_case`):

* ``tilefuse``: ``swiglu_fp8`` with block scales (x 1 x 128 groups, w 128 x 128 blocks) and the
  output re-quantized to e4m3 with 1 x 128 group scales (DeepSeek-V3's recipe end to end);
* ``tilefuse:bf16_out``: the same with a bf16 output;
* ``tilefuse:rowwise``: per-token x / per-channel w scales, e4m3 output;
* ``tilefuse:ws`` / ``tilefuse:ws_rowwise``: the first and the third with the Gluon
  warp-specialized kernel pinned (variant ``ws``; sm_90 only);
* ``tilefuse:tl`` / ``tilefuse:decode`` (M <= 16): the first with the tiled ``tl`` kernel, or the
  split-K decode kernel, pinned (the default at these M is the decode kernel);
* ``tilefuse:unfused`` / ``tilefuse:unfused_rowwise``: the first and the third with the unfused
  pipeline pinned (``torch._scaled_mm`` + tilefuse's SiLU·mul pass with the re-quantization: the
  baseline candidate the cost model weighs; block scales where ``scaled_mm_block`` runs);
* ``scaled_mm``: the bare merged GEMM ``torch._scaled_mm(x, W^T)`` with row-wise scales, bf16
  out (cuBLASLt's FP8 GEMM): the floor a fused kernel is judged against;
* ``scaled_mm_block``: the same GEMM with 1 x 128 / 128 x 128 block scales, where cuBLASLt takes
  them (M and K/128 multiples of 4: ``configs.unfused_form``; elsewhere it fails or, at K/128 =
  7, returns wrong sums);
* ``unfused``: the pipeline the fused kernel replaces: ``scaled_mm`` + PyTorch SiLU * mul +
  re-quantization of ``h`` to e4m3 in 1 x 128 groups.

Accuracy (``rel_err`` against the fp64 spec from the same e4m3 inputs and scales, first
``ACC_ROWS`` rows), row-wise scales and bf16 outputs on both sides: ``tilefuse:rowwise`` with a
bf16 output against ``scaled_mm`` (bf16) + SiLU * mul; the goal: tilefuse's within 1.5x of that.

Goals (graph replay): ``tilefuse`` / ``scaled_mm`` time geomean <= 1.0; ``unfused`` / ``tilefuse``
>= 1.5 at M <= 1024.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tilefuse.bench.harness import Case, Goal, PlotSpec, check, compare, geomean, group_rows, tally

ACC_ROWS = 256


def _case(model: str, hidden: int, inter: int, m: int, device) -> Case:
    import tilefuse
    from tilefuse.ops.swiglu_fp8 import configs
    from tilefuse.ops.swiglu_fp8.op import ws_usable
    from tilefuse.ops.swiglu_fp8.reference import FP8, quantize_fp8
    from tilefuse.testing.swiglu import make_fp8_case, reference_fp8_fp64

    state: dict = {}

    def setup():
        block = make_fp8_case(m, hidden, inter, device)
        row = make_fp8_case(m, hidden, inter, device, x_scaling="token", w_scaling="channel")
        state.update(row=row)
        x, xs, w, ws = row.args()
        ws_row = ws.reshape(1, -1)

        def gemm():
            return torch._scaled_mm(x, w.T, scale_a=xs, scale_b=ws_row, out_dtype=torch.bfloat16)

        def unfused():
            y = gemm()
            return quantize_fp8(F.silu(y[:, :inter]) * y[:, inter:])

        bx, bxs, bw, bws = block.args()
        bxs_t = bxs.t().contiguous().t()          # cuBLASLt's block scales: M-major activations scales
        block_ok = configs.unfused_form(m, hidden, "k", "k") == "block"     # M, K/128 multiples of 4
        def pinned(case, variant="ws"):
            def run():
                with tilefuse.force(variant=variant):
                    return tilefuse.swiglu_fp8(*case.args(), out_dtype=FP8)
            return run

        impls = {
            "tilefuse": lambda: tilefuse.swiglu_fp8(*block.args(), out_dtype=FP8),
            "tilefuse:bf16_out": lambda: tilefuse.swiglu_fp8(*block.args()),
            "tilefuse:rowwise": lambda: tilefuse.swiglu_fp8(*row.args(), out_dtype=FP8),
            **({"tilefuse:ws": pinned(block), "tilefuse:ws_rowwise": pinned(row)} if ws_usable(device) else {}),
            **({"tilefuse:tl": pinned(block, "tl"), "tilefuse:decode": pinned(block, "decode")}
               if m <= configs.DECODE_MAX_M else {}),
            **({"tilefuse:unfused": pinned(block, "unfused")} if block_ok else {}),
            "tilefuse:unfused_rowwise": pinned(row, "unfused"),
            "scaled_mm": gemm,
            **({"scaled_mm_block": lambda: torch._scaled_mm(bx, bw.T, scale_a=bxs_t, scale_b=bws.T,
                                                            out_dtype=torch.bfloat16)} if block_ok else {}),
            "unfused": unfused,
        }
        state.update(gemm=gemm)
        return impls

    def extras(impls):
        try:
            row = state["row"]
            rows = torch.arange(min(m, ACC_ROWS), device=device)
            ref = reference_fp8_fp64(row, rows)

            def rel(out):
                return ((out.double() - ref).norm() / ref.norm()).item()

            x, xs, w, ws = row.args()
            y = state["gemm"]()[rows].float()
            return {"tilefuse:rowwise": {"rel_err_bf16_out": rel(tilefuse.swiglu_fp8(*row.args())[rows])},
                    "scaled_mm": {"rel_err_unfused_bf16": rel((F.silu(y[:, :inter]) * y[:, inter:]).bfloat16())}}
        finally:
            state.clear()

    return Case(params={"model": model, "H": hidden, "I": inter, "M": m, "dtype": "e4m3"},
                flops=2.0 * m * 2 * inter * hidden,
                bytes=1.0 * (m * hidden + 2 * inter * hidden + m * inter),
                setup=setup, extras=extras)


QUICK_M = (1, 128, 4096)
FULL_M = (1, 16, 128, 333, 1024, 4096, 16384)


def unavailable(device: torch.device) -> str | None:
    """Why this family has no case on ``device`` (None where it has): an sm_90 GPU or newer."""
    need = "the FP8 kernels need an NVIDIA GPU of sm_90 or newer (FP8 tensor cores, TMA)"
    if device.type != "cuda":
        return f"{need}; there is no CUDA GPU here"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{need}; this GPU is sm_{major}{minor}" if major < 9 else None


def cases(device: torch.device, quick: bool, subset: bool = False) -> list[Case]:
    """Qwen2.5 (0.5B/7B/72B when quick) and Llama-3 MLP shapes; none where :func:`unavailable` says why."""
    from tilefuse.testing.swiglu import LLAMA3_SHAPES, SHAPES

    if unavailable(device):
        return []
    shapes = {**SHAPES, **LLAMA3_SHAPES}
    if quick:
        shapes = {k: shapes[k] for k in ("0.5B", "7B", "72B", "L3-8B")}
    return [_case(name, h, i, m, device) for name, (h, i) in shapes.items()
            for m in (QUICK_M if quick else FULL_M)]


PLOT = PlotSpec(x="M", line=("model",), facet="dtype", roofline_if=lambda p: p["M"] <= 16,
                goals={"graph": [Goal(1.0, "goal: geomean >= 1 (vs bare _scaled_mm)")]})


def summarize(rows: list[dict]) -> dict:
    """Goals from one run: fused / bare ``_scaled_mm`` (graph, geomean), speedup over the unfused
    FP8 pipeline at M <= 1024, accuracy against ``_scaled_mm``'s."""
    by_case = group_rows(rows, ("model", "M", "dtype"))
    cases, vs_unfused, acc = [], [], []
    for (model, m, _), impls in by_case.items():
        entry = compare(f"{model} M={m}", next(iter(impls.values()))["params"], impls, ("tilefuse", "tilefuse"),
                        ("scaled_mm", "scaled_mm"))
        for name in ("scaled_mm_block", "unfused", "tilefuse:rowwise", "tilefuse:bf16_out", "tilefuse:unfused",
                     "tilefuse:unfused_rowwise", "tilefuse:ws",
                     "tilefuse:ws_rowwise", "tilefuse:tl", "tilefuse:decode"):
            entry[f"{name}_graph_us"] = (impls.get(name) or {}).get("graph_us")
        unf = entry["unfused_graph_us"] and entry["graph_us"] and entry["unfused_graph_us"] / entry["graph_us"]
        if m <= 1024 and unf:
            entry["kernel_goals"].append(check("unfused / tilefuse graph_us", unf, ">=", 1.5))
            vs_unfused.append(entry["kernel_goals"][-1])
        ours = (impls.get("tilefuse:rowwise") or {}).get("rel_err_bf16_out")
        theirs = (impls.get("scaled_mm") or {}).get("rel_err_unfused_bf16")
        if ours is not None and theirs:
            acc.append(check(f"{model} M={m}: rel_err / scaled_mm's", ours / theirs, "<=", 1.5))
        cases.append(entry)
    ratios = [1 / e["graph_speedup"] for e in cases if e["graph_speedup"]]
    row_ratios = [e["tilefuse:rowwise_graph_us"] / e["baseline_graph_us"] for e in cases
                  if e["tilefuse:rowwise_graph_us"] and e["baseline_graph_us"]]
    # the dispatch's pick (block scales, e4m3 out) against the best pinned path of the same call
    regret = [e["graph_us"] / best for e in cases if e["graph_us"] and (best := min(
        (e[f"tilefuse:{v}_graph_us"] for v in ("ws", "tl", "decode", "unfused") if e[f"tilefuse:{v}_graph_us"]),
        default=None))]
    return {
        "timing": "graph_us (CUDA-graph replay, cold L2); eager_us for the host path",
        "cases": cases,
        "pick_over_best_pinned": {"geomean": geomean(regret), "max": max(regret, default=None),
                                  "what": "default (block scales, e4m3 out) / the fastest pinned path: ws, tl, "
                                          "decode, unfused"},
        "goals": [
            check("graph: geomean tilefuse (block scales, e4m3 out) / bare scaled_mm time", geomean(ratios), "<=", 1.0),
            check("graph: geomean tilefuse:rowwise (e4m3 out) / bare scaled_mm time", geomean(row_ratios), "<=", 1.0),
            tally("graph, M <= 1024: >= 1.5x faster than the unfused FP8 pipeline", vs_unfused),
            tally("accuracy: rel_err within 1.5x of _scaled_mm's", acc),
        ],
        "max_time_over_scaled_mm": max(ratios, default=None),
        "ws_kernel_time_over_scaled_mm": {
            kind: {"geomean": geomean(r), "max": max(r, default=None)}
            for kind, r in (("block", [e["tilefuse:ws_graph_us"] / e["baseline_graph_us"] for e in cases
                                       if e["tilefuse:ws_graph_us"] and e["baseline_graph_us"]]),
                            ("rowwise", [e["tilefuse:ws_rowwise_graph_us"] / e["baseline_graph_us"] for e in cases
                                         if e["tilefuse:ws_rowwise_graph_us"] and e["baseline_graph_us"]])) if r},
    }
