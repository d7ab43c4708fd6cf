"""Sweep the launch configs of the fused SwiGLU kernels on a GPU and pick one per shape.

    python3 tools/tune_swiglu.py [OUT_DIR] [--mode full|tail|tiles|pingpong] [--configs FILE]
    python3 tools/tune_swiglu.py --mode promote        # time and accuracy of per-K-step promotion
    python3 tools/tune_swiglu.py --mode fp8            # swiglu_fp8 tiles (tl and Gluon) per (output, M)
    python3 tools/tune_swiglu.py --mode fp8decode      # the FP8 decode kernel's tiles (M = 1, 16)
    TILEFUSE_CONFIGS=configs.json tilefuse bench swiglu  # then measure the picks

Every candidate is timed as CUDA-graph replays (cold L2, median) of ``run_kernel`` with that
config (merged layout, bf16), beside the bare merged cuBLAS GEMM, so host launch cost does not
hide kernel time. The config the op uses today (``configs.choose``) is candidate 0 and stays
unless another is at least 2 % faster. Modes (which shapes, which candidates):

* ``full``: every Qwen2.5 shape x benchmark M; short lists of small-M (M <= 1024) and large-M
  (M >= 128) tile configs;
* ``tail``: the shapes whose last wave of tiles is partial, with stream-K tails and a few tile sizes;
* ``tiles``: data-parallel tile shapes whose tile count fills the waves better (small models at
  M = 128 / 1024, stream-K variants at 7B);
* ``pingpong``: the Gluon ping-pong kernel's tiles and stages against the current pick, every
  Qwen2.5 shape at M = 128 .. 16384.

Every time goes to ``OUT_DIR/swiglu-<mode>-sweep-<gpu>.json`` (default ``bench/results/sweeps/``);
the changed picks are merged into the ``"swiglu"`` section of the configs file (``[{"H", "I", "M",
"variant", "config"}]``), and the whole table is printed in the form of ``TUNED`` in
``tilefuse/ops/swiglu/configs.py``. Needs a CUDA GPU; ``pingpong``, ``fp8`` and ``fp8decode`` an
sm_90 one.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from sweep_common import parse_args, read_configs, require_gpu, sweep_path, update_section, write_json

KEEP_MARGIN = 0.98   # a candidate replaces the current config only if it takes < 98 % of its time


def candidates(mode: str, model: str, m: int, inter: int) -> list:
    """The configs ``mode`` tries at (model, M), besides the current one."""
    from tilefuse.ops.swiglu.configs import LargeMConfig as L
    from tilefuse.ops.swiglu.configs import PingPongConfig as P
    from tilefuse.ops.swiglu.configs import SmallMConfig as S

    if mode == "pingpong":
        return [P(128, 64, 64, 8, 4), P(128, 64, 64, 8, 3), P(128, 64, 128, 8, 2), P(64, 128, 64, 8, 4)]
    if mode == "full":
        out = []
        if m <= 16:
            out += [S(16, 32, 128, 1, 4), S(16, 32, 256, 1, 3), S(16, 64, 128, 1, 4), S(16, 64, 256, 1, 3),
                    S(16, 16, 256, 1, 4), S(16, 64, 128, 2, 4), S(16, 32, 256, 2, 3)]
            out += [S(16, 32, 128, 4, 4)] if inter < 8192 else []
        elif m <= 128:
            out += [S(64, 32, 128, 1, 4), S(64, 64, 128, 1, 3), S(64, 64, 64, 1, 4), S(128, 64, 64, 1, 4, 8),
                    S(128, 32, 128, 1, 3), S(64, 64, 128, 2, 3)]
        elif m <= 1024:
            out += [S(64, 64, 64, 1, 4), S(128, 64, 64, 1, 4, 8), S(128, 128, 64, 1, 3, 8)]
        if m >= 128:
            out += [L(128, 128, 64, 8, 3, 8, True), L(128, 128, 64, 8, 4, 8, True), L(128, 128, 64, 8, 3, 8, False),
                    L(128, 64, 64, 8, 4, 4, False), L(128, 64, 64, 8, 4, 8, True), L(64, 128, 64, 8, 4, 4, False),
                    L(128, 128, 64, 4, 3, 8, True), L(128, 128, 128, 8, 2, 8, True)]
        return out
    if mode == "tail":
        if m <= 16:
            return [S(16, 64, 128, 1, 4), S(16, 64, 256, 1, 3), S(16, 32, 128, 1, 4), S(16, 32, 256, 1, 3),
                    S(16, 16, 256, 1, 4), S(16, 128, 128, 1, 4, 8), S(16, 64, 128, 2, 4)]
        stream_k = [L(128, 128, 64, 8, 4, 8, False, 1), L(128, 128, 64, 8, 4, 8, False, 2),
                    L(128, 64, 64, 8, 4, 4, False, 1), L(128, 64, 64, 8, 4, 4, False, 2)]
        extra = [L(64, 128, 64, 8, 4, 4, False, 1)] if m == 128 else [L(128, 128, 64, 8, 3, 8, False, 1)]
        return stream_k + extra
    # tiles
    data_parallel = [L(64, 128, 64, 8, 4, 4, False), L(128, 64, 64, 8, 4, 4, False), L(64, 64, 64, 8, 4, 4, False)]
    if model == "7B":
        return [L(128, 64, 64, 8, 3, 4, False, 1), L(64, 64, 64, 8, 4, 4, False, 1), L(64, 128, 64, 8, 4, 4, False)]
    if m == 128 and model in ("0.5B", "1.5B"):
        return [S(64, 32, 128, 1, 4), S(128, 32, 128, 1, 3), S(64, 64, 128, 1, 3), S(128, 64, 64, 1, 4, 8),
                S(64, 128, 64, 1, 3, 8), S(32, 64, 128, 1, 4), S(64, 64, 64, 2, 4), S(32, 32, 128, 1, 4),
                *data_parallel]
    if m == 1024:
        return data_parallel + [L(64, 128, 64, 8, 3, 4, False), L(128, 64, 64, 8, 4, 8, False),
                                L(128, 128, 64, 8, 4, 8, False)]
    return data_parallel


def shapes(mode: str) -> list[tuple[str, int]]:
    """(model, M) pairs of a mode."""
    from tilefuse.testing.swiglu import BENCH_M, SHAPES

    if mode == "full":
        return [(model, m) for model in SHAPES for m in BENCH_M]
    if mode == "pingpong":
        return [(model, m) for model in SHAPES for m in BENCH_M if m >= 128]
    if mode == "tail":
        return ([(model, 128) for model in SHAPES]
                + [(model, 1024) for model in ("0.5B", "1.5B", "3B", "14B", "32B")] + [("0.5B", 4096)]
                + [(model, m) for model in ("0.5B", "1.5B") for m in (1, 16)])
    return [("0.5B", 128), ("1.5B", 128), ("3B", 128), ("0.5B", 1024), ("1.5B", 1024), ("3B", 1024), ("7B", 128)]


def sweep(mode: str) -> tuple[list[dict], list[dict], dict]:
    """(every time, the changed picks as "swiglu" entries, the full table {(H, I): {M: config}})."""
    import torch
    import torch.nn.functional as F

    from tilefuse.bench.harness import Timer
    from tilefuse.ops.swiglu import configs
    from tilefuse.ops.swiglu.op import run_kernel
    from tilefuse.testing.swiglu import SHAPES, make_case

    timer = Timer(torch.device("cuda"), rep_ms=12.0, warmup_ms=3.0)

    def graph_us(fn) -> float:
        try:
            return timer.graph_us(fn)
        except Exception as exc:  # a config that does not compile or run is skipped, loudly
            print(f"    ! {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr, flush=True)
            return float("inf")

    results, changed, table, t0 = [], [], {}, time.time()
    for model, m in shapes(mode):
        h, i = SHAPES[model]
        x, w, _ = make_case(m, h, i, torch.bfloat16, "cuda")
        out = torch.empty((m, i), dtype=torch.bfloat16, device="cuda")
        floor = graph_us(lambda: F.linear(x, w))
        current = configs.choose(m, h, i)[1]
        cands = [current] + [c for c in candidates(mode, model, m, i) if c != current]
        timed = [(c, graph_us(lambda c=c: run_kernel(x, w, None, config=c, out=out))) for c in cands]
        best, us = min(timed, key=lambda t: t[1])
        if us > KEEP_MARGIN * timed[0][1]:
            best, us = timed[0]
        variant = configs.variant_of(best)
        print(f"{model:>5} M={m:<6} cublas {floor:9.1f} us  current {timed[0][1]:9.1f} ({timed[0][1] / floor:.3f})  "
              f"best {us:9.1f} ({us / floor:.3f})  {best}", flush=True)
        results.append({"model": model, "H": h, "I": i, "M": m, "cublas_graph_us": floor,
                        "candidates": [{"config": repr(c), "graph_us": t} for c, t in timed]})
        table.setdefault((h, i), {})[m] = best
        if best != current:
            changed.append({"H": h, "I": i, "M": m, "variant": variant, "config": dataclasses.asdict(best)})
        del x, w, out
        torch.cuda.empty_cache()
    print(f"sweep took {time.time() - t0:.0f} s", file=sys.stderr)
    return results, changed, table


FP8_SHAPES = ("L3-8B", "72B")


def fp8_candidates(quant: bool) -> list:
    """swiglu_fp8 tiles (block scales) that fit the register budget (ptxas, sm_90a: no spills): the
    tl kernel's (Fp8Config) and the Gluon kernel's (WsConfig)."""
    from tilefuse.ops.swiglu_fp8.configs import Fp8Config as F
    from tilefuse.ops.swiglu_fp8.configs import WsConfig as W

    if quant:   # BLOCK_N = 128: one output group per tile row
        return [F(64, 128, 128, 8, 4, 8), F(64, 128, 128, 8, 3, 8), F(64, 128, 128, 4, 4, 8),
                W(128, 4), W(128, 3), W(128, 5), W(128, 4, 4)]
    return [F(64, 128, 128, 8, 4, 8), F(128, 64, 128, 8, 4, 8), F(128, 64, 128, 8, 3, 8), F(64, 64, 128, 8, 4, 4),
            F(64, 64, 128, 8, 3, 4), F(64, 64, 128, 8, 2, 4), W(128, 4), W(64, 4), W(64, 5), W(128, 3)]


def fp8_sweep() -> tuple[list[dict], list[dict]]:
    """Block-scaled swiglu_fp8 (x 1 x 128 groups, w 128 x 128 blocks), bf16 and e4m3 outputs: every
    candidate's CUDA-graph time on the FP8_SHAPES at M = 128, 1024, 4096, 16384; per (output, M) the
    config with the least total time over the shapes (the heuristic's unless 2 % faster)."""
    import torch

    from tilefuse.bench.harness import Timer
    from tilefuse.ops.swiglu_fp8 import configs
    from tilefuse.ops.swiglu_fp8.op import _as_2d, launch_ws, run_kernel, ws_usable
    from tilefuse.testing.swiglu import LLAMA3_SHAPES, SHAPES, make_fp8_case

    timer = Timer(torch.device("cuda"), rep_ms=12.0, warmup_ms=3.0)
    shapes = {**SHAPES, **LLAMA3_SHAPES}
    results, picks = [], []
    for quant in (False, True):
        for m in (128, 1024, 4096, 16384):
            totals: dict = {}
            for model in FP8_SHAPES:
                h, i = shapes[model]
                case = make_fp8_case(m, h, i, "cuda")
                x, xs, w, ws = case.args()
                out = torch.empty((m, i), dtype=torch.float8_e4m3fn if quant else torch.bfloat16, device="cuda")
                oscale = torch.empty((m, i // 128), dtype=torch.float32, device="cuda")
                current = configs.heuristic(m, h, i, quant)
                for c in [current] + [c for c in fp8_candidates(quant) if c != current]:
                    ws_kernel = isinstance(c, configs.WsConfig)
                    if ws_kernel and not ws_usable(x.device):
                        continue
                    launch = launch_ws if ws_kernel else run_kernel
                    try:
                        us = timer.graph_us(lambda c=c, launch=launch: launch(x, _as_2d(xs, m), w, ws, out, oscale, c,
                                                                              True, True, quant))
                    except Exception as exc:
                        print(f"    ! {c}: {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr, flush=True)
                        us = float("inf")
                    totals[c] = totals.get(c, 0.0) + us
                    results.append({"model": model, "M": m, "quant": quant, "config": repr(c), "graph_us": us})
                    print(f"fp8 quant={quant} {model:>6} M={m:<5} {us:9.1f} us  {c}", flush=True)
                del case, x, xs, w, ws, out
                torch.cuda.empty_cache()
            current = configs.heuristic(m, *shapes[FP8_SHAPES[0]], quant)
            best = min(totals, key=totals.get)
            if totals[best] > KEEP_MARGIN * totals.get(current, float("inf")):
                best = current
            print(f"fp8 quant={quant} M={m}: pick {best}", flush=True)
            picks.append({"quant": quant, "M": m, "config": dataclasses.asdict(best),
                          **({"variant": "ws"} if isinstance(best, configs.WsConfig) else {})})
    return results, picks


def fp8_decode_candidates() -> list:
    """The FP8 decode kernel's launch configs (``DecodeConfig``: block_m, block_n, stages, warps,
    programs per SM; the split follows from the last); an e4m3 output runs each with 128 columns.
    16 rows run ``mma.sync`` on e4m3 converted to fp16; 64 rows run FP8 WGMMA directly (sm_90a,
    ptxas: 101-206 registers with 8 warps, no spills; 4 warps spill with 128 columns)."""
    from tilefuse.ops.swiglu_fp8.configs import DecodeConfig as D

    return [D(), D(block_n=32), D(block_n=128), D(num_warps=8), D(block_n=128, num_warps=8), D(num_stages=3),
            D(num_stages=6), D(programs_per_sm=2), D(programs_per_sm=8), D(block_n=128, num_warps=8, programs_per_sm=8),
            D(block_m=64, num_warps=8), D(block_m=64, num_warps=8, programs_per_sm=8)]


def fp8_decode_sweep() -> tuple[list[dict], list[dict]]:
    """Block-scaled swiglu_fp8 at M = 1 and 16 through the decode kernel, bf16 and e4m3 outputs:
    every candidate's CUDA-graph time on four shapes (0.5B, 7B, Llama-3-8B, 72B), beside the tiled
    tl kernel's; per output the candidate with the least total time over shapes and M (the default
    unless 2 % faster), as a "decode" entry for the M = 16 bucket."""
    import torch

    from tilefuse.bench.harness import Timer
    from tilefuse.ops.swiglu_fp8 import configs
    from tilefuse.ops.swiglu_fp8.op import _as_2d, launch_decode, run_kernel
    from tilefuse.testing.swiglu import LLAMA3_SHAPES, SHAPES, make_fp8_case

    timer = Timer(torch.device("cuda"), rep_ms=12.0, warmup_ms=3.0)
    shapes = {**SHAPES, **LLAMA3_SHAPES}
    results, picks = [], []
    for quant in (False, True):
        totals: dict = {}
        for model in ("0.5B", "7B", "L3-8B", "72B"):
            h, i = shapes[model]
            for m in (1, 16):
                case = make_fp8_case(m, h, i, "cuda")
                x, xs, w, ws = case.args()
                out = torch.empty((m, i), dtype=torch.float8_e4m3fn if quant else torch.bfloat16, device="cuda")
                oscale = torch.empty((m, i // 128), dtype=torch.float32, device="cuda")
                tl_cfg = configs.heuristic(m, h, i, quant)
                tl_us = timer.graph_us(lambda: run_kernel(x, _as_2d(xs, m), w, ws, out, oscale, tl_cfg, True, True,
                                                          quant))
                for base in fp8_decode_candidates():
                    c = configs.decode_config(m, h, i, quant, base=base)
                    try:
                        us = timer.graph_us(lambda c=c: launch_decode(x, _as_2d(xs, m), w, ws, out, oscale, c, True,
                                                                      True, quant))
                    except Exception as exc:
                        print(f"    ! {c}: {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr, flush=True)
                        us = float("inf")
                    totals[base] = totals.get(base, 0.0) + us
                    results.append({"model": model, "M": m, "quant": quant, "config": repr(c), "graph_us": us,
                                    "tl_graph_us": tl_us})
                    print(f"fp8 decode quant={quant} {model:>6} M={m:<3} {us:8.1f} us (tl {tl_us:8.1f})  {c}",
                          flush=True)
                del case, x, xs, w, ws, out
                torch.cuda.empty_cache()
        default = configs.DecodeConfig()
        best = min(totals, key=totals.get)
        if totals[best] > KEEP_MARGIN * totals[default]:
            best = default
        print(f"fp8 decode quant={quant}: pick {best} ({totals[best]:.1f} us vs {totals[default]:.1f})", flush=True)
        picks.append({"quant": quant, "M": 16, "variant": "decode", "config": dataclasses.asdict(best)})
    return results, picks


def print_table(table: dict) -> None:
    """The picks in the form of ``TUNED`` in ``configs.py``."""
    print("TUNED = {")
    for (h, i), per_m in table.items():
        print(f"    ({h}, {i}): {{")
        for m, cfg in sorted(per_m.items()):
            short = repr(cfg).replace("SmallMConfig", "S").replace("LargeMConfig", "L").replace("PingPongConfig", "P")
            print(f"        {m}: {short},")
        print("    },")
    print("}")


def promote_check() -> None:
    """Per-K-step promotion (``config.promote``): graph time and accuracy against the current configs."""
    import torch

    from tilefuse.bench.harness import Timer
    from tilefuse.ops.swiglu import configs
    from tilefuse.ops.swiglu.op import run_kernel
    from tilefuse.testing.compare import frac_beyond_ulp
    from tilefuse.testing.swiglu import SHAPES, make_case, reference_fp64

    timer = Timer(torch.device("cuda"), rep_ms=12.0, warmup_ms=3.0)
    for model in ("0.5B", "7B", "14B", "72B"):
        h, i = SHAPES[model]
        for m in (1, 16, 128):
            x, w, _ = make_case(m, h, i, torch.bfloat16, "cuda")
            ref = reference_fp64(x, w)
            variant, cfg = configs.choose(m, h, i)
            line = [f"{model:>5} M={m:<4} {variant:<8}"]
            for promote in (False, True):
                c = dataclasses.replace(cfg, promote=promote)
                us = timer.graph_us(lambda c=c: run_kernel(x, w, None, config=c))
                frac = frac_beyond_ulp(run_kernel(x, w, None, config=c), ref)
                line.append(f"promote={promote}: {us:8.1f} us, {frac:.2e} beyond 1 ulp")
            print("  ".join(line), flush=True)


def main() -> None:
    mode = dict(choices=["full", "tail", "tiles", "pingpong", "promote", "fp8", "fp8decode"], default="full",
                help="which sweep (see above)")
    args = parse_args(__doc__, workers=False, **{"--mode": mode})
    if args.mode in ("pingpong", "fp8", "fp8decode"):
        require_gpu((9, 0))
    out = sweep_path(f"swiglu-{args.mode}-sweep", args.out_dir)
    if args.mode == "promote":
        promote_check()
        return
    if args.mode in ("fp8", "fp8decode"):
        results, picks = fp8_sweep() if args.mode == "fp8" else fp8_decode_sweep()
        write_json(out, results)
        kept = [e for e in read_configs(args.configs).get("swiglu_fp8", [])
                if (e.get("variant") == "decode") != (args.mode == "fp8decode")]
        configs = {**read_configs(args.configs), "swiglu_fp8": kept + picks}
        args.configs.parent.mkdir(parents=True, exist_ok=True)
        args.configs.write_text(json.dumps(configs, indent=1) + "\n")
        print(f"picks merged into {args.configs}: TILEFUSE_CONFIGS={args.configs} tilefuse bench swiglu_fp8")
        return
    results, changed, table = sweep(args.mode)
    print_table(table)
    write_json(out, results)
    if changed:
        update_section(args.configs, "swiglu", changed)
        print(f"{len(changed)} changed picks merged into {args.configs}: "
              f"TILEFUSE_CONFIGS={args.configs} tilefuse bench swiglu --only '\"M\": <M>' to measure them")
    else:
        print("no config changed")


if __name__ == "__main__":
    main()
