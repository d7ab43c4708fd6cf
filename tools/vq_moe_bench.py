"""2-bit MoE experts (``tilefuse.vq_moe``) against bf16 experts, through transformers' own experts module.

    python3 tools/vq_moe_bench.py [OUT_DIR] [--quick]

Per expert shape (:data:`SHAPES`: Qwen3-30B-A3B's routed experts, and a held-out DeepSeek-V2-Lite /
Qwen1.5-MoE-A2.7B-like shape no setting was chosen on) and token count (1-128), with uniform random
top-k routing (distinct experts per token, softmax weights), times

* ``vq2``: ``tilefuse.vq_moe`` on 2-bit experts (``VQMoEExperts.from_experts(random_codes=True)``);
* ``vq2:per_pair``, ``vq2:grouped``: the same with a program per token-expert pair, or per tile of
  one expert's tokens (sorted on the device), forced (the op picks by ``configs.MOE["group_pairs"]``);
* ``vq2:dequant``: the dequantize path (every expert dequantized into a scratch weight, then
  PyTorch's grouped GEMM: ``op.launch_moe_dequant``), forced (the op picks it from
  ``configs.MOE["dequant_pairs"]`` pairs on, 0 as shipped: never);
* ``vq2:<setting>``: other launch settings (:data:`SETTINGS`: codebook copies, row tiles, K slices,
  16-token tiles; at :data:`SETTING_TOKENS` tokens);
* ``bf16:grouped_mm``: transformers' ``Qwen3MoeExperts`` in bf16 with ``experts_implementation=
  "grouped_mm"`` (sort by expert, ``torch.nn.functional.grouped_mm``; graph-capturable), on the
  2-bit experts' dequantized weights (so its output checks ours);
* ``bf16:batched_mm``: the same module with ``"batched_mm"`` (copies each pair's weights);
* ``bf16:loop``: the module's stock loop (``"eager"``: reads the routing back, no CUDA graph; eager
  wall time only).

Times: ``graph_us`` (median of ``triton.testing.do_bench`` over CUDA-graph replays of one call,
L2 flushed before each: ``tilefuse.bench.harness.Timer``) and ``eager_us`` (wall time per call of
back-to-back eager calls). Each row carries the experts hit, the bytes of their weights (2-bit
codes + codebooks + scales; bf16) and the copy-bandwidth time of those bytes (``floor_us``, the
run's own measured ceiling). Every output is checked against the bf16 grouped_mm module before it
is timed (relative Frobenius error below 2^-6; a wrong one gets no time). Writes
``OUT_DIR/vq-moe-<gpu>.json`` (default ``bench/results/sweeps/``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

SHAPES = [  # (name, E, H, I, top-k)
    ("qwen3-30b-a3b", 128, 2048, 768, 8),
    ("held-out e64 2048x1408 top-6", 64, 2048, 1408, 6),
]
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)
MODES = {"per_pair": False, "grouped": True}      # vq2:<mode>: the programs forced, at every token count
SETTINGS = {  # name -> (gate/up overrides, down overrides of configs.moe_config, grouped or None: the op's)
    "copies2": (dict(copies=2), dict(copies=2), None),
    "copies8": (dict(copies=8), dict(copies=8), None),
    "rows32": (dict(row_tiles=2, slices=4, krep=2), dict(row_tiles=2, slices=4, krep=2), None),
    "slices4": (dict(slices=4), dict(slices=4), None),
    "grouped_tokens16": (dict(tokens=16), dict(tokens=16), True),
}
SETTING_TOKENS = (1, 16, 128)


def log(msg: str) -> None:
    print(f"[vq_moe {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def stock_experts(e: int, h: int, i: int, impl: str, device):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e, num_experts_per_tok=8)
    config._experts_implementation = impl
    with torch.device(device):
        return Qwen3MoeExperts(config).to(torch.bfloat16)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="bench/results/sweeps")
    parser.add_argument("--quick", action="store_true", help="fewer token counts, shorter timings")
    parser.add_argument("--tokens", type=lambda v: tuple(int(t) for t in v.split(",")), default=None,
                        help="token counts, comma-separated (prefill sizes: 256,512,1024,2048); above 128 the "
                             "bf16 batched_mm and loop modules are not timed")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)     # tests: a dry run elsewhere
    args = parser.parse_args(argv)
    if args.device == "cuda":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import sweep_common

        sweep_common.require_gpu()

    from tilefuse.bench.harness import Timer, measure_ceilings
    from tilefuse.bench.runner import _slug, machine_info
    from tilefuse.nn import VQMoEExperts
    from tilefuse.ops.vq import op as vq_op

    device = torch.device(args.device)
    timer = Timer(device, rep_ms=20.0 if args.quick else 40.0, eager_ms=10.0 if args.quick else 20.0)
    ceilings = measure_ceilings(device, quick=True)
    bw = ceilings.copy_gbps * 1e3                  # bytes per us
    tokens = args.tokens or (TOKENS if not args.quick else (1, 4, 8, 16, 32, 64, 128))
    rows = []
    for name, e, h, i, k in SHAPES:
        log(f"{name}: building E={e} H={h} I={i} top-{k}")
        torch.manual_seed(0)
        grouped = stock_experts(e, h, i, "grouped_mm", device)
        torch.nn.init.normal_(grouped.gate_up_proj, std=0.02)
        torch.nn.init.normal_(grouped.down_proj, std=0.02)
        vq = VQMoEExperts.from_experts(grouped, random_codes=True)
        with torch.no_grad():
            gate_up, down = vq.dequantize()
            grouped.gate_up_proj.copy_(gate_up)
            grouped.down_proj.copy_(down)
        del gate_up, down
        batched = stock_experts(e, h, i, "batched_mm", device)
        loop = stock_experts(e, h, i, "eager", device)
        for other in (batched, loop):       # share the weights
            other.gate_up_proj, other.down_proj = grouped.gate_up_proj, grouped.down_proj
        vq_bytes_per_expert = 3 * i * h // 4 + 2 * 2 * 256 * 8 * 2 + 3 * i * 2 + h * 2
        bf16_bytes_per_expert = 3 * i * h * 2
        for t in tokens:
            x = torch.randn(t, h, device=device, dtype=torch.bfloat16)
            index = torch.rand(t, e, device=device).argsort(dim=1)[:, :k].contiguous()
            weights = torch.rand(t, k, device=device).softmax(dim=1).to(torch.bfloat16)
            hit = int(torch.unique(index).numel())
            common = {"shape": name, "E": e, "H": h, "I": i, "top_k": k, "tokens": t, "experts_hit": hit}
            with torch.no_grad():
                want = grouped(x, index, weights).float()
            impls = {"vq2": (lambda: vq(x, index, weights), True),
                     "bf16:grouped_mm": (lambda: grouped(x, index, weights), True),
                     "bf16:batched_mm": (lambda: batched(x, index, weights), True),
                     "bf16:loop": (lambda: loop(x, index, weights), False)}
            if t > 128:                 # batched_mm copies each pair's weights; the loop is eager only
                del impls["bf16:batched_mm"], impls["bf16:loop"]
            call_of = {}
            plans = {f"vq2:{mode}": ({}, {}, forced) for mode, forced in MODES.items()}
            if t in SETTING_TOKENS:
                plans.update({f"vq2:{setting}": value for setting, value in SETTINGS.items()})
            for label, (gu, dn, forced) in plans.items():
                call_of[label] = call = vq_op._moe_plan(t, k, e, h, i, device, "auto", gu, dn, forced)

                def run(call=call, x=x, index=index, weights=weights, t=t):
                    out = torch.empty(t, h, dtype=x.dtype, device=device)
                    return vq_op.launch_moe(call, x, index, weights, vq.gate_up_codes, vq.gate_up_codebooks,
                                            vq.gate_up_scales, vq.down_codes, vq.down_codebooks, vq.down_scales, out)
                impls[label] = (run, True)
            call_of["vq2:dequant"] = dequant = vq_op._moe_plan(t, k, e, h, i, device, "auto", dequant=True)

            def run_dequant(call=dequant, x=x, index=index, weights=weights, t=t):
                out = torch.empty(t, h, dtype=x.dtype, device=device)
                return vq_op.launch_moe_dequant(call, x, index, weights, vq.gate_up_codes, vq.gate_up_codebooks,
                                                vq.gate_up_scales, vq.down_codes, vq.down_codebooks, vq.down_scales,
                                                out)
            impls["vq2:dequant"] = (run_dequant, True)
            for impl, (fn, graphable) in impls.items():
                row = dict(common, impl=impl)
                if impl.startswith("vq2"):
                    plan = vq_op._plan_moe(x, index, weights, *(getattr(vq, n) for n in (
                        "gate_up_codes", "gate_up_codebooks", "gate_up_scales", "down_codes", "down_codebooks",
                        "down_scales"))) if impl == "vq2" else call_of.get(impl)
                    if plan is not None and plan.gate_up is not None:
                        row.update(grouped=plan.grouped, tiles=plan.tiles, gate_up_meta=plan.gate_up[2],
                                   down_meta=plan.down[2])
                nbytes = hit * (vq_bytes_per_expert if impl.startswith("vq2") else bf16_bytes_per_expert)
                row.update(weight_bytes=nbytes, floor_us=nbytes / bw)
                try:
                    with torch.no_grad():
                        got = fn().float()
                        err = ((got - want).norm() / want.norm()).item()
                        row["rel_err_vs_grouped_mm"] = err
                        if not err < 2.0 ** -6:
                            raise AssertionError(f"relative error {err:.3g} against bf16 grouped_mm")
                        row["eager_us"] = timer.eager_us(fn)[0]
                        if graphable:
                            row["graph_us"] = timer.graph_us(fn)
                except Exception as exc:      # noqa: BLE001 - recorded in the row, the run goes on
                    row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                rows.append(row)
                log(f"{name} T={t} {impl}: graph {row.get('graph_us', '-')} eager {row.get('eager_us', '-')} "
                    f"{row.get('error', '')}")
        grouped = batched = loop = vq = None       # free the experts before the next shape
        torch.cuda.empty_cache()
    summary = {}
    for name, *_ in SHAPES:
        for t in tokens:
            by = {r["impl"]: r for r in rows if r["shape"] == name and r["tokens"] == t}
            ours, base = by.get("vq2", {}).get("graph_us"), by.get("bf16:grouped_mm", {}).get("graph_us")
            if ours and base:
                summary.setdefault(name, {})[f"T={t}"] = {
                    "vq2_graph_us": round(ours, 2), "grouped_mm_graph_us": round(base, 2),
                    "x_grouped_mm": round(base / ours, 3),
                    "x_batched_mm": round(by.get("bf16:batched_mm", {}).get("graph_us", float("nan")) / ours, 3),
                    "x_loop_eager": round(by.get("bf16:loop", {}).get("eager_us", float("nan"))
                                          / by["vq2"]["eager_us"], 3)}
    machine = machine_info(device)
    out = Path(args.out_dir) / f"vq-moe-{_slug(machine['gpu'])}{'-quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "ceilings": {"copy_gbps": ceilings.copy_gbps,
                                                                 "gemm_bf16_tflops": ceilings.gemm_bf16_tflops},
                               "timing": {"graph_us": "median do_bench over CUDA-graph replays of one call, L2 "
                                                      "flushed before each", "eager_us": "wall time per call of "
                                                      "back-to-back eager calls (host included)"},
                               "settings": {k: list(v) for k, v in SETTINGS.items()}, "rows": rows,
                               "summary": summary}, indent=1, default=str) + "\n")
    print(json.dumps(summary, indent=1))
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
