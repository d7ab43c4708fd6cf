"""Config sweeps for the fused SwiGLU kernels on the H200 (run by scripts/gpu_swiglu.sh).

``tune_swiglu.py tail OUT``: the focused sweep of the tail-wave shapes (stream-K and tile-size
candidates, see docs/swiglu.md), timed as CUDA-graph replays (cold L2, median) like the benchmark's
launch-bound rows, so Triton's host launch cost does not hide the kernel time; writes every time to
OUT/swiglu-tail-sweep.json and the winners to OUT/swiglu-tail-configs.json (TILEFUSE_SWIGLU_CONFIGS).

``tune_swiglu.py [OUT]``: the original full sweep (eager do_bench; host-bound at small shapes).

For every Qwen2.5 shape x M of the benchmark, times the bare merged cuBLAS GEMM and a short list
of candidate configs of both kernels (merged layout; the best large-M ones also in the packed
layout), then prints the winners as the ``TUNED`` table of ``tilefuse/ops/swiglu/configs.py``.
Median of ``triton.testing.do_bench`` (cold L2). Usage: ``python3 scripts/tune_swiglu.py [OUT_DIR]``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from tilefuse.ops.swiglu.configs import LargeMConfig as L
from tilefuse.ops.swiglu.configs import SmallMConfig as S
from tilefuse.ops.swiglu.op import pack_gate_up, run_kernel
from tilefuse.testing.swiglu import BENCH_M, QWEN25_SHAPES, make_inputs


def small_candidates(m: int, inter: int) -> list[S]:
    if m <= 16:
        base = [S(16, 32, 128, 1, 4), S(16, 32, 256, 1, 3), S(16, 64, 128, 1, 4), S(16, 64, 256, 1, 3),
                S(16, 16, 256, 1, 4), S(16, 64, 128, 2, 4), S(16, 32, 256, 2, 3)]
        if inter < 8192:
            base += [S(16, 32, 128, 4, 4)]
        return base
    if m <= 128:
        return [S(64, 32, 128, 1, 4), S(64, 64, 128, 1, 3), S(64, 64, 64, 1, 4), S(128, 64, 64, 1, 4, 8),
                S(128, 32, 128, 1, 3), S(64, 64, 128, 2, 3)]
    return [S(64, 64, 64, 1, 4), S(128, 64, 64, 1, 4, 8), S(128, 128, 64, 1, 3, 8)]


LARGE = [L(128, 128, 64, 8, 3, 8, True), L(128, 128, 64, 8, 4, 8, True), L(128, 128, 64, 8, 3, 8, False),
         L(128, 64, 64, 8, 4, 4, False), L(128, 64, 64, 8, 4, 8, True), L(64, 128, 64, 8, 4, 4, False),
         L(128, 128, 64, 4, 3, 8, True), L(128, 128, 128, 8, 2, 8, True)]


def bench(fn) -> float:
    try:
        return 1e3 * do_bench(fn, warmup=5, rep=12, return_mode="median")
    except Exception as exc:  # a config that does not compile or run is skipped, loudly
        print(f"    ! {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        return float("inf")


def main(out_dir: Path) -> None:
    results, table = [], {}
    t_start = time.time()
    for model, (h, i) in QWEN25_SHAPES.items():
        for m in BENCH_M:
            x, w, _ = make_inputs(m, h, i, torch.bfloat16, "cuda")
            packed = pack_gate_up(w[:i], w[i:])
            out = torch.empty((m, i), dtype=torch.bfloat16, device="cuda")
            floor = bench(lambda: F.linear(x, w))
            timed = []
            if m <= 1024:
                for cfg in small_candidates(m, i):
                    timed.append(("merged", cfg, bench(lambda c=cfg: run_kernel(x, w, None, config=c, out=out))))
            if m >= 128:
                for cfg in LARGE:
                    timed.append(("merged", cfg, bench(lambda c=cfg: run_kernel(x, w, None, config=c, out=out))))
                best_large = sorted((t for t in timed if isinstance(t[1], L)), key=lambda t: t[2])[:2]
                for _, cfg, _ in best_large:
                    timed.append(("packed", cfg, bench(
                        lambda c=cfg: run_kernel(x, packed, None, "packed", config=c, out=out))))
            merged = [t for t in timed if t[0] == "merged"]
            layout, cfg, us = min(merged, key=lambda t: t[2])
            best_packed = min((t[2] for t in timed if t[0] == "packed"), default=None)
            table.setdefault((h, i), {})[m] = cfg
            print(f"{model:>5} M={m:<6} cublas {floor:9.1f} us  best {us:9.1f} us  ratio {us / floor:.3f}  "
                  f"packed {best_packed if best_packed is None else round(best_packed / floor, 3)}  {cfg}",
                  flush=True)
            results.append({"model": model, "H": h, "I": i, "M": m, "cublas_us": floor,
                            "candidates": [{"layout": la, "config": repr(c), "us": u} for la, c, u in timed]})
            del x, w, packed, out
            torch.cuda.empty_cache()
    print(f"sweep took {time.time() - t_start:.0f} s")
    print("TUNED = {")
    for (h, i), per_m in table.items():
        print(f"    ({h}, {i}): {{")
        for m, cfg in per_m.items():
            print(f"        {m}: {repr(cfg).replace('SmallMConfig', 'S').replace('LargeMConfig', 'L')},")
        print("    },")
    print("}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "swiglu-tune-h200.json").write_text(json.dumps(results, indent=1) + "\n")


def graph_us(fn, rep: int = 10) -> float:
    """Median CUDA-graph replay time (cold L2) of fn, in us; inf if it does not compile or run."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return 1e3 * do_bench(graph.replay, warmup=3, rep=rep, return_mode="median")
    except Exception as exc:
        print(f"    ! {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        return float("inf")


SK = [L(128, 128, 64, 8, 4, 8, False, 1), L(128, 128, 64, 8, 4, 8, False, 2), L(128, 64, 64, 8, 4, 4, False, 1),
      L(128, 64, 64, 8, 4, 4, False, 2)]
TAIL_CASES = {  # (model, M): extra candidates beyond SK and the tuned entry
    **{(model, 128): [L(64, 128, 64, 8, 4, 4, False, 1)] for model in QWEN25_SHAPES},
    **{(model, 1024): [L(128, 128, 64, 8, 3, 8, False, 1)] for model in ("0.5B", "1.5B", "3B", "14B", "32B")},
    ("0.5B", 4096): [L(128, 128, 64, 8, 3, 8, False, 1)],
    **{(model, m): [S(16, 64, 128, 1, 4), S(16, 64, 256, 1, 3), S(16, 32, 128, 1, 4), S(16, 32, 256, 1, 3),
                    S(16, 16, 256, 1, 4), S(16, 128, 128, 1, 4, 8), S(16, 64, 128, 2, 4)]
       for model in ("0.5B", "1.5B") for m in (1, 16)},
}


# Second pass (after stream-K lost on the small models): data-parallel tile shapes whose tile
# count fills the waves better, for the small models' M = 128 / 1024 rows; stream-K variants at 7B.
_SMALL_128 = [S(64, 32, 128, 1, 4), S(128, 32, 128, 1, 3), S(64, 64, 128, 1, 3), S(128, 64, 64, 1, 4, 8),
              S(64, 128, 64, 1, 3, 8), S(32, 64, 128, 1, 4), S(64, 64, 64, 2, 4), S(32, 32, 128, 1, 4)]
_DP = [L(64, 128, 64, 8, 4, 4, False), L(128, 64, 64, 8, 4, 4, False), L(64, 64, 64, 8, 4, 4, False)]
TILE_CASES = {
    ("0.5B", 128): _SMALL_128 + _DP, ("1.5B", 128): _SMALL_128 + _DP, ("3B", 128): _DP,
    **{(model, 1024): _DP + [L(64, 128, 64, 8, 3, 4, False), L(128, 64, 64, 8, 4, 8, False),
                             L(128, 128, 64, 8, 4, 8, False)] for model in ("0.5B", "1.5B", "3B")},
    ("7B", 128): [L(128, 64, 64, 8, 3, 4, False, 1), L(64, 64, 64, 8, 4, 4, False, 1), L(64, 128, 64, 8, 4, 4, False)],
}


def tail_sweep(out_dir: Path, cases: dict, tag: str = "tail", with_sk: bool = True) -> None:
    from tilefuse.ops.swiglu import configs

    results, winners, changed, t0 = [], [], [], time.time()
    for (model, m), extra in cases.items():
        h, i = QWEN25_SHAPES[model]
        x, w, _ = make_inputs(m, h, i, torch.bfloat16, "cuda")
        out = torch.empty((m, i), dtype=torch.bfloat16, device="cuda")
        floor = graph_us(lambda: F.linear(x, w))
        variant, tuned = configs.choose(m, h, i)
        cands = [tuned] + [c for c in (extra if m <= 16 or not with_sk else SK + extra) if c != tuned]
        timed = [(c, graph_us(lambda c=c: run_kernel(x, w, None, config=c, out=out))) for c in cands]
        best, us = min(timed, key=lambda t: t[1])
        if us > 0.98 * timed[0][1]:  # keep the tuned entry unless a candidate is clearly faster
            best, us = timed[0]
        print(f"{model:>5} M={m:<5} cublas {floor:8.1f}  tuned {timed[0][1]:8.1f} ({timed[0][1] / floor:.3f})  "
              f"best {us:8.1f} ({us / floor:.3f}) {best}", flush=True)
        for c, t in sorted(timed, key=lambda t: t[1])[:4]:
            print(f"        {t:8.1f} {c}")
        results.append({"model": model, "H": h, "I": i, "M": m, "cublas_graph_us": floor,
                        "candidates": [{"config": repr(c), "graph_us": t} for c, t in timed]})
        if best != timed[0][0]:
            changed.append(f"{model}:{m}")
        winners.append({"H": h, "I": i, "M": m, "variant": "small_m" if isinstance(best, S) else "large_m",
                        "config": dict(best.__dict__)})
        del x, w, out
        torch.cuda.empty_cache()
    print(f"tail sweep took {time.time() - t0:.0f} s", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"swiglu-{tag}-sweep.json").write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / "swiglu-tail-configs.json").write_text(json.dumps(winners, indent=1) + "\n")
    # The cases whose config changed, for the partial benchmark that follows (TILEFUSE_BENCH_SWIGLU_CASES).
    (out_dir / "changed.txt").write_text(",".join(changed) + "\n")


def merge(full: Path, partials: list[tuple[Path, list[str]]], out: Path) -> None:
    """Replace the rows of the re-run cases ("model:M") in the full benchmark JSON by those of the
    partial runs (tilefuse + baselines timed together); rows get a "run" tag (machine date) and the
    summary is recomputed. torch_compile rows (not re-run) stay from the full run."""
    from tilefuse.bench.swiglu import summarize

    data = json.loads(full.read_text())
    for row in data["rows"]:
        row.setdefault("run", data["machine"]["date"])
    for path, cases in partials:
        part = json.loads(path.read_text())
        keep = {tuple(c.split(":")) for c in cases}
        new = [dict(r, run=part["machine"]["date"]) for r in part["rows"]
               if (r["params"]["model"], str(r["params"]["M"])) in keep]
        replaced = {(r["params"]["model"], r["params"]["M"], r["impl"]) for r in new}
        rows = []
        for r in data["rows"]:
            key = (r["params"]["model"], r["params"]["M"], r["impl"])
            if key in replaced:
                rows.append(next(n for n in new if (n["params"]["model"], n["params"]["M"], n["impl"]) == key))
                replaced.discard(key)
            elif not ((r["params"]["model"], str(r["params"]["M"])) in keep and r["impl"] != "torch_compile"):
                rows.append(r)
        rows += [n for n in new if (n["params"]["model"], n["params"]["M"], n["impl"]) in replaced]
        data["rows"] = rows
    data["summary"] = summarize(data["rows"])
    data["notes"] = list(data.get("notes", [])) + [
        "Rows tagged with a later 'run' date come from partial re-runs (scripts/gpu_swiglu.sh tail|tiles, "
        "bench/results/swiglu-h200-tail-run{1,2}.json) after the tuned configs of those cases changed: "
        + "; ".join(f"{p.name}: {', '.join(c)}" for p, c in partials) + ". Their torch_compile rows are from "
        "the full run. The summary is recomputed over the merged rows."]
    out.write_text(json.dumps(data, indent=1, default=str) + "\n")


def promote_check() -> None:
    """Per-K-step promotion (config.promote): time and accuracy against the tuned kernels."""
    import dataclasses

    from tilefuse.ops.swiglu import configs
    from tilefuse.testing import frac_beyond_ulp
    from tilefuse.testing.swiglu import reference_f64

    for model in ("0.5B", "7B", "14B", "72B"):
        h, i = QWEN25_SHAPES[model]
        for m in (1, 16, 128):
            x, w, _ = make_inputs(m, h, i, torch.bfloat16, "cuda")
            ref = reference_f64(x, w)
            variant, cfg = configs.choose(m, h, i)
            row = [f"{model:>5} M={m:<4} {variant:<8}"]
            for promote in (False, True):
                c = dataclasses.replace(cfg, promote=promote)
                us = bench(lambda c=c: run_kernel(x, w, None, config=c))
                frac = frac_beyond_ulp(run_kernel(x, w, None, config=c), ref)
                row.append(f"promote={promote}: {us:8.1f} us frac {frac:.2e}")
            print("  ".join(row), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["promote"]:
        promote_check()
    elif sys.argv[1:2] == ["tail"]:
        tail_sweep(Path(sys.argv[2] if len(sys.argv) > 2 else "bench/results"), TAIL_CASES)
    elif sys.argv[1:2] == ["merge"]:  # merge FULL OUT PARTIAL CASES [PARTIAL CASES ...]
        args = sys.argv[4:]
        merge(Path(sys.argv[2]), [(Path(args[k]), args[k + 1].split(",")) for k in range(0, len(args), 2)],
              Path(sys.argv[3]))
    elif sys.argv[1:2] == ["tiles"]:
        tail_sweep(Path(sys.argv[2] if len(sys.argv) > 2 else "bench/results"), TILE_CASES, "tiles", False)
    else:
        main(Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results"))
