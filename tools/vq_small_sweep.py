"""Small-layer VQ timings: the 2-bit layer against fp16 cuBLAS at 1-128 tokens, every path.

    python3 tools/vq_small_sweep.py [OUT_DIR] [--quick] [--settings] [--swiglu] [--workers N] [--compile-only]

One run gives, per layer (MoE experts, k/v and o projections, two large layers and held-out
shapes) and per token count (1, 2, 4, 8, 16, 32, 128), CUDA-graph replay times (cold L2, the
median of ``triton.testing.do_bench`` over replays, ``tilefuse.bench.harness.Timer``) of

* ``fp16``: cuBLAS on the dense fp16 weight (``F.linear`` on the dequantized weight),
* ``dequant``: dequantize + cuBLAS (``force(variant="dequant")``), the baseline of a 2-bit weight,
* ``default``: ``vq_matmul`` as dispatched, with the variant the dispatch picked,
* every kernel forced (``decode`` up to 2 tokens, ``mma`` up to 16, ``small``, ``prefill``),
* ``null``: a graph of one one-element kernel (the replay's own floor in this timing),

with ``--swiglu`` (instead of the above, into ``vq-swiglu-<gpu>.json``) the 2-bit gate/up projection with its SwiGLU epilogue (``vq_swiglu``, the weight
shape ``N x K`` is each of gate and up) against ``silu(g) * u`` from two fp16 cuBLAS calls, one fp16
cuBLAS call on the concatenated ``[2N, K]`` weight (what a merged gate/up checkpoint runs), two
``vq_matmul`` calls as dispatched, two forced ``small`` calls and the fused kernel forced (rows
``swiglu:<path>``), and with
``--settings`` the small-layer kernel at every setting of :data:`SETTINGS` (K slices,
codebook copies, K step, row tiles) on the small layers at 1 and 16 tokens. Each output is checked
against fp32 ``F.linear`` on the dequantized weight before it is timed (a wrong one gets no time).
Timings go to ``OUT_DIR/vq-small-<gpu>.json`` (default ``bench/results/sweeps/``), with the
dispatch's predicted time beside each default row. The kernels compile first in ``--workers``
processes at once (Triton's disk cache then serves the timed process).
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sweep_common  # noqa: E402

LAYERS = [(2048, 768), (768, 2048), (1024, 4096), (512, 2048), (4096, 4096), (14336, 4096)]
HELD_OUT = [(1408, 2048), (2048, 1408)]          # no setting or fit of the dispatch saw these
SMALL = [(2048, 768), (768, 2048), (1024, 4096), (512, 2048), (1408, 2048), (2048, 1408)]
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)
# the first run (vq-small-h200.json) timed 2-8 slices x 1-8 copies, a 64-input step and 32-row
# programs: 8 slices won, copies within noise of each other; these are the next candidates (16
# slices; 8-token tiles at 9-16 tokens, which halve the x^T a program reads and double the programs)
SETTINGS = [dict(slices=8, copies=8, krep=4), dict(slices=16, copies=8, krep=4), dict(slices=8, copies=8, krep=4, tokens=8),
            dict(slices=16, copies=8, krep=4, tokens=8), dict(slices=8, copies=2, krep=4), dict(slices=16, copies=2, krep=4)]
SETTING_TOKENS = (1, 16)
# gate/up weights N x K (intermediate x hidden): Qwen3-30B-A3B and DeepSeek-V2-Lite experts, a
# small dense MLP, Llama-3-8B; held out: OLMoE's experts (1024 x 2048); Qwen2.5-1.5B's MLP and a
# 4096 x 4096 one
SWIGLU_LAYERS = [(768, 2048), (1408, 2048), (2048, 768), (14336, 4096), (1024, 2048), (8960, 1536), (4096, 4096)]
SWIGLU_TOKENS = (1, 4, 16, 32, 64, 128)


def _case(n, k, m):
    import torch

    from tilefuse.ops.vq.reference import dequantize
    from tilefuse.testing.vq import make_case

    case = make_case(m, n, k, torch.float16, "cuda")
    w = dequantize(case.codes, case.codebooks, case.scales, dtype=torch.float16)
    return case, w


def _paths(case, w, m):
    """{impl: zero-argument call} of every path at ``m`` tokens."""
    import torch
    import torch.nn.functional as F

    import tilefuse

    x, codes, books, scales = case.x, case.codes, case.codebooks, case.scales

    def forced(variant):
        def call():
            with tilefuse.force(variant=variant):
                return tilefuse.vq_matmul(x, codes, books, scales)
        return call

    paths = {"fp16": lambda: F.linear(x, w), "dequant": forced("dequant"),
             "default": lambda: tilefuse.vq_matmul(x, codes, books, scales)}
    if m <= 2:
        paths["decode"] = forced("decode")
    if m <= 16:
        paths["mma"] = forced("mma")
    paths["small"] = forced("small")            # above 16 tokens: 16-token tiles
    if m > 2 and torch.cuda.get_device_capability()[0] == 9:
        paths["prefill"] = forced("prefill")
    return paths


def _swiglu_case(n, k, m):
    import torch

    from tilefuse.ops.vq.reference import dequantize
    from tilefuse.testing.vq import make_case, make_weight

    gate = make_case(m, n, k, torch.float16, "cuda")
    up = make_weight(n, k, torch.float16, "cuda")
    weights = (gate.codes, gate.codebooks, gate.scales, *up)
    wg = dequantize(gate.codes, gate.codebooks, gate.scales, dtype=torch.float16)
    wu = dequantize(*up, dtype=torch.float16)
    return gate.x, weights, wg, wu


def _swiglu_paths(x, weights, wg, wu):
    """{impl: zero-argument call} of every gate/up path."""
    import torch
    import torch.nn.functional as F

    import tilefuse

    gate, up = weights[:3], weights[3:]
    w_cat = torch.cat([wg, wu])
    n = wg.shape[0]

    def merged():
        h = F.linear(x, w_cat)
        return F.silu(h[:, :n]) * h[:, n:]

    def two(variant=None):
        def call():
            if variant is None:
                return F.silu(tilefuse.vq_matmul(x, *gate)) * tilefuse.vq_matmul(x, *up)
            with tilefuse.force(variant=variant):
                return F.silu(tilefuse.vq_matmul(x, *gate)) * tilefuse.vq_matmul(x, *up)
        return call

    paths = {"swiglu:fp16": lambda: F.silu(F.linear(x, wg)) * F.linear(x, wu), "swiglu:fp16_merged": merged,
             "swiglu:two_vq": two(), "swiglu:fused": lambda: tilefuse.vq_swiglu(x, *weights)}
    if x.shape[0] <= 16:
        paths["swiglu:two_small"] = two("small")

    def forced_fused():
        with tilefuse.force(variant="small"):
            return tilefuse.vq_swiglu(x, *weights)

    paths["swiglu:fused_forced"] = forced_fused      # the fused kernel wherever the dispatch would not run it
    return paths


def _setting_call(case, m, setting):
    import torch

    from tilefuse.ops.vq import op as vq_op

    n = case.codes.shape[0]
    out = torch.empty(m, n, dtype=case.x.dtype, device="cuda")
    return lambda: vq_op.launch_small(case.x, case.codes, case.codebooks, case.scales.reshape(n), None, out,
                                      impl="gluon", **setting)


def _jobs(settings: bool, quick: bool, swiglu: bool = False):
    if swiglu:
        return [("swiglu", n, k, m, None) for (n, k) in SWIGLU_LAYERS for m in SWIGLU_TOKENS]
    layers = (LAYERS[:4] + HELD_OUT[:1]) if quick else LAYERS + HELD_OUT
    jobs = [("paths", n, k, m, None) for (n, k) in layers for m in TOKENS]
    if settings:
        jobs += [("setting", n, k, m, s) for (n, k) in (SMALL[:3] if quick else SMALL) for m in SETTING_TOKENS
                 for s in SETTINGS]
    return jobs


def _warm(job):
    """Compile a job's kernels (one call each), in a worker process: Triton's disk cache keeps them."""
    import torch

    kind, n, k, m, setting = job
    try:
        torch.manual_seed(0)
        if kind == "swiglu":
            calls = _swiglu_paths(*_swiglu_case(n, k, m)).values()
        else:
            case, w = _case(n, k, m)
            calls = _paths(case, w, m).values() if kind == "paths" else [_setting_call(case, m, setting)]
        for call in calls:
            try:
                call()
            except Exception:  # timed (and recorded as failing) in the main process
                pass
        torch.cuda.synchronize()
    except Exception as exc:  # pragma: no cover - reported by the timed run
        return repr(exc)[:200]
    return None


def main(argv=None) -> None:
    args = sweep_common.parse_args(__doc__, argv, workers=True, configs=False,
                                   **{"--settings": dict(action="store_true", help="time every small-kernel setting"),
                                      "--swiglu": dict(action="store_true", help="time the fused 2-bit gate/up"),
                                      "--workers": dict(type=int, default=12, help="compile processes"),
                                      "--compile-only": dict(action="store_true",
                                                             help="compile every kernel (Triton's cache), time nothing")})
    import torch

    from tilefuse import _dispatch
    from tilefuse.ops.vq import configs
    from tilefuse.ops.vq import op as vq_op

    jobs = _jobs(args.settings, args.quick, args.swiglu)
    t0 = time.time()
    if args.workers > 1:
        with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
            errors = [e for e in pool.map(_warm, jobs, chunksize=1) if e]
        print(f"compiled in {time.time() - t0:.0f} s ({len(errors)} failures: {errors[:3]})", file=sys.stderr)
    if args.compile_only:
        return
    record = sweep_common.GraphRecorder(max_rel_err=5e-3, rep_ms=10)
    device = torch.device("cuda")
    chip, sms = _dispatch.chip(device), torch.cuda.get_device_properties(device).multi_processor_count
    one = torch.zeros(1, device="cuda")
    record.rows.append(dict(N=0, K=0, tokens=0, impl="null", us=record.timer.graph_us(lambda: one.add_(1.0)),
                            rel_err=0.0))
    print(f"null graph: {record.rows[-1]['us']:.2f} us", file=sys.stderr)
    last = None
    path = sweep_common.sweep_path("vq-swiglu" if args.swiglu else "vq-small", args.out_dir)
    about = dict(quick=args.quick, timing="CUDA-graph replay, cold L2, median of triton.testing.do_bench (rep 10 ms); "
                 "fp16 inputs", chip=chip.name, sms=sms)
    for i, (kind, n, k, m, setting) in enumerate(jobs):
        if i % 40 == 39:        # a run cut short keeps what it timed
            sweep_common.write_json(path, record.rows, **about, complete=False)
        if kind == "swiglu":
            torch.manual_seed(n * 131 + k * 7 + m)
            x, weights, wg, wu = _swiglu_case(n, k, m)
            ref = torch.nn.functional.silu(x.float() @ wg.float().T) * (x.float() @ wu.float().T)
            for impl, call in _swiglu_paths(x, weights, wg, wu).items():
                record(n, k, m, impl, call, ref)
            last = None
            continue
        if (n, k, m) != last:
            torch.manual_seed(n * 131 + k * 7 + m)
            case, w = _case(n, k, m)
            ref = torch.nn.functional.linear(case.x.float(), w.float())
            last = (n, k, m)
        if kind == "paths":
            for impl, call in _paths(case, w, m).items():
                extra = {}
                if impl == "default":
                    choice = vq_op.decision(m, n, k, device, vq_op.wgmma_prefill_applies(k, device))
                    extra = dict(variant=choice.variant, predicted={c.variant: c.predicted_us
                                                                    for c in choice.candidates})
                if impl == "small":
                    extra = dict(config=configs.small_config(m, n, k, True, sms))
                record(n, k, m, impl, call, ref, **extra)
        else:
            record(n, k, m, "small:setting", _setting_call(case, m, setting), ref,
                   config=configs.small_config(m, n, k, True, sms, **setting))
    sweep_common.write_json(path, record.rows, **about, complete=True, seconds=round(time.time() - t0))


if __name__ == "__main__":
    main()
