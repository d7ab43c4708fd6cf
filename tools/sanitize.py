"""Every kernel once, on small shapes, for NVIDIA's compute-sanitizer (memcheck, racecheck).

Covers each kernel and variant, and for MLA the adversarial contents that must stay in bounds:
block tables with -1, 10^6 and INT32_MAX pages below the lengths, lengths past the block table,
zeroed and wild metadata, and num_splits that do not match it. Outputs of the adversarial cases
are unspecified; the point is that no access leaves its tensor.

    compute-sanitizer --tool memcheck  --error-exitcode 1 python3 tools/sanitize.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python3 tools/sanitize.py --one
    compute-sanitizer --tool racecheck --error-exitcode 1 python3 tools/sanitize.py --one --gluon
    compute-sanitizer --tool racecheck --error-exitcode 1 python3 tools/sanitize.py --one --only "mla h16 wgmma"

Set ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` so that reads past a tensor land outside any allocation
(with the caching allocator they may land in a neighbouring block and go unseen). ``--one``:
one case per kernel (racecheck is slow); ``--gluon`` limits it to the VQ Gluon kernels; ``--only
PREFIX`` to the cases whose name starts with PREFIX (a family, or e.g. ``"mla h16 wgmma"``). Run
it with the repository on ``PYTHONPATH`` (or tilefuse installed).
"""

from __future__ import annotations

import argparse
import sys

import torch

import tilefuse
from tilefuse.ops.swiglu import configs as swiglu_configs
from tilefuse.ops.swiglu.op import run_kernel
from tilefuse.ops.vq import op as vq_op
from tilefuse.testing import mla as mla_cases
from tilefuse.testing import swiglu as swiglu_cases
from tilefuse.testing import vq as vq_cases

# On a machine without CUDA (TRITON_INTERPRET=1 set before this runs) the cases run in Triton's
# interpreter, in fp16: a check of this script itself.
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = torch.bfloat16 if DEV == "cuda" else torch.float16


def swiglu_cases_to_run(one: bool):
    x, w, b = swiglu_cases.make_case(5, 264, 200, DT, DEV, bias=True)
    yield "swiglu small_m split-K", lambda: run_kernel(x, w, b, config=swiglu_configs.SmallMConfig(16, 32, 64, 3))
    if one:
        return
    yield "swiglu small_m", lambda: run_kernel(x, w, b, variant="small_m")
    xl, wl, bl = swiglu_cases.make_case(300, 264, 200, DT, DEV, bias=True)
    yield "swiglu large_m", lambda: run_kernel(xl, wl, bl, variant="large_m")
    yield "swiglu large_m stream-K", lambda: run_kernel(
        xl, wl, bl, config=swiglu_configs.LargeMConfig(64, 64, 64, 2, 2, 4, False, stream_k=1), num_sms=5)
    if DEV == "cuda":   # the Gluon kernel (elsewhere the pin runs the large-M kernel again)
        xp, wp, bp = swiglu_cases.make_case(5000, 264, 200, DT, DEV, bias=True)   # 160 tiles: both consumers
        yield "swiglu pingpong", lambda: run_kernel(xp, wp, bp, variant="pingpong")


def swiglu_fp8_cases_to_run(one: bool):
    if DEV != "cuda":          # FP8 tensor cores: the kernels run on an sm_90 GPU only
        return
    from tilefuse.ops.swiglu_fp8.reference import FP8

    block = swiglu_cases.make_fp8_case(300, 384, 256, DEV)          # 3 row tiles, 2 (1) column tiles
    row = swiglu_cases.make_fp8_case(300, 400, 192, DEV, x_scaling="token", w_scaling="channel")
    for variant in ("tl", "ws"):
        yield f"swiglu_fp8 {variant} e4m3", lambda variant=variant: _forced(
            variant, tilefuse.swiglu_fp8, *block.args(), out_dtype=FP8)
        if not one:
            yield f"swiglu_fp8 {variant} rowwise bf16", lambda variant=variant: _forced(
                variant, tilefuse.swiglu_fp8, *row.args())


def vq_cases_to_run(one: bool, gluon: bool):
    for m, impl in ((1, "resident"), (3, "gather"), (2, "tl"), (16, "prefill"), (16, "dequant")):
        if (gluon and impl not in ("resident", "gather")) or (DEV != "cuda" and impl in ("resident", "gather")):
            continue        # the Gluon kernels need a GPU
        c = vq_cases.make_case(m, 200, 1040, DT, DEV, bias=True)
        out = torch.empty(m, 200, dtype=DT, device=DEV)
        args = (c.x, c.codes, c.codebooks, c.scales.reshape(200), c.bias, out)
        if impl in ("prefill", "dequant"):
            launch = getattr(vq_op, f"launch_{impl}")
            yield f"vq {impl}", lambda launch=launch, args=args: launch(*args)
        else:
            yield f"vq decode {impl}", lambda args=args, impl=impl: vq_op.launch_decode(*args, impl=impl)
    if DEV == "cuda" and not gluon:   # the WGMMA prefill kernel (Hopper; K a multiple of 64), both forms, split-K
        c = vq_cases.make_case(70, 200, 1024, DT, DEV, bias=True)
        out = torch.empty(70, 200, dtype=DT, device=DEV)
        args = (c.x, c.codes, c.codebooks, c.scales.reshape(200), c.bias, out)
        for ws in (0, 1):
            yield f"vq prefill wgmma ws={ws}", lambda args=args, ws=ws: vq_op.launch_prefill(*args, impl="wgmma", ws=ws)


def mla_cases_to_run(one: bool):
    for h_q in (16, 128):
        inp = mla_cases.make_case([130, 70, 0, 700], 1, h_q, DT, DEV)
        meta, splits = tilefuse.get_mla_metadata(inp.cache_seqlens, h_q, 1, num_sm_parts=6)
        for variant in ("transposed", "standard", "wgmma"):   # each kernel, whatever the default
            if variant != "transposed" or h_q < 64:
                yield f"mla h{h_q} {variant}", lambda inp=inp, meta=meta, splits=splits, variant=variant: (
                    _forced(variant, tilefuse.flash_mla_with_kvcache, *inp.args(), 512, meta, splits, causal=True))
        if one:
            continue
        b = inp.q.shape[0]
        for bad in (-1, 10 ** 6, 2 ** 31 - 1):
            table = inp.block_table.clone()
            table[0, 1] = bad
            table[3, 5] = bad
            yield f"mla h{h_q} block_table {bad}", lambda inp=inp, table=table, meta=meta, splits=splits: (
                tilefuse.flash_mla_with_kvcache(inp.q, inp.k_cache, table, inp.cache_seqlens, 512, meta, splits))
        long = torch.full_like(inp.cache_seqlens, 10 ** 7)
        yield f"mla h{h_q} lengths past the table", lambda inp=inp, long=long, meta=meta, splits=splits: (
            tilefuse.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, long, 512, meta, splits))
        wild = meta.clone()
        wild[:, 0] = torch.tensor([10 ** 6, -7, b, 2 ** 31 - 1], dtype=torch.int32).repeat(meta.shape[0])[:meta.shape[0]]
        wild[:, 1] = 10 ** 6
        wild_splits = torch.tensor([0, 10 ** 6, -5, 2 ** 31 - 1, 3], dtype=torch.int32, device=DEV)
        # counts that overflow int32 when differenced or scaled: the bounds must hold before arithmetic
        overflow = torch.tensor([2 ** 31 - 1, -2 ** 31 + 5, 2 ** 31 - 1, -2 ** 31 + 3, 4], dtype=torch.int32, device=DEV)
        for name, (md, ns) in {"zeroed": (torch.zeros_like(meta), torch.zeros_like(splits)),
                               "wild metadata": (wild, splits), "wild num_splits": (meta, wild_splits),
                               "overflowing num_splits": (meta, overflow)}.items():
            yield f"mla h{h_q} {name}", lambda inp=inp, md=md, ns=ns: tilefuse.flash_mla_with_kvcache(
                *inp.args(), 512, md, ns, causal=True)


def _forced(variant, fn, *args, **kwargs):
    with tilefuse.force(variant=variant):
        return fn(*args, **kwargs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", action="store_true", help="one case per kernel")
    parser.add_argument("--gluon", action="store_true", help="only the Gluon (VQ decode) kernels")
    parser.add_argument("--only", default=None, help="only the cases whose name starts with this (e.g. mla)")
    args = parser.parse_args(argv)
    if DEV != "cuda" and not tilefuse._backend.interpreting():
        from sweep_common import require_gpu

        require_gpu(otherwise="(or TRITON_INTERPRET=1 to run the cases in Triton's interpreter)")
    families = {"vq": lambda: vq_cases_to_run(args.one, args.gluon)}
    if not args.gluon:
        families = {"swiglu": lambda: swiglu_cases_to_run(args.one),
                    "swiglu_fp8": lambda: swiglu_fp8_cases_to_run(args.one), **families,
                    "mla": lambda: mla_cases_to_run(args.one)}
    runs = [(name, fn) for family, cases in families.items()
            if args.only is None or family.startswith(args.only) or args.only.startswith(family)
            for name, fn in cases() if args.only is None or name.startswith(args.only)]
    for name, fn in runs:
        with tilefuse.force(backend="triton"):
            fn()
        if DEV == "cuda":
            torch.cuda.synchronize()
        print(f"ran {name}", file=sys.stderr, flush=True)
    print(f"{len(runs)} cases ran", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
