"""Every public op and nn module under ``torch.compile(fullgraph=True)``, static shapes and
``dynamic=True``, compiled in a fresh process *before* any eager call of it, outputs compared with
the fp64 reference.

The cases (:data:`CASES`) are driven by the registry: every public function of every family
(``tilefuse._registry.FAMILIES``) and every module of ``tilefuse.nn`` needs one, or
``test_every_public_op_and_module_has_a_compile_case`` fails.

How a case runs: this file, run as a script (``python tests/test_compile.py MODE DEVICE``), builds
each case's inputs with ``tilefuse.testing`` and the references only (no eager call of any op),
then per case resets dynamo and every cached call plan and ``functools`` cache of tilefuse
(:func:`fresh`), compiles, runs (``dynamic``: two input sizes through the one compiled function)
and checks (``dynamic``: the second size must reuse the first graph, no recompile); it prints
one JSON line per case. The tests run one process per mode and device and
report each case. On the CPU the reference backend (``tilefuse.force(backend="reference")``, fp32)
and the kernels in Triton's interpreter (fp16), compiled with ``aot_eager`` (no C++ toolchain
needed); on a GPU the kernels (bf16), compiled with the default backend (Inductor), as a user
would.

Tolerances (each output against the fp64 reference of the same rounded inputs):

* CPU, fp32 reference path: ``atol = rtol = 1e-4``: fp32 sums of at most 576 O(1) products are
  within ~1e-6 of fp64; the FP8 SwiGLU's bf16 output: ``atol 1e-3, rtol 2^-8`` (one bf16 rounding
  of h, and h's O(1) values give 2^-9 at most).
* GPU, bf16: the families' own bounds: SwiGLU, VQ and the MLP ``atol 1e-2, rtol 2^-7`` (one bf16
  ulp of the output plus fp32 accumulation); FP8 SwiGLU ``atol 1e-3, rtol 2^-7``; MLA ``cos_diff
  < 1e-5`` and ``atol = rtol = 1e-2`` on out, ``atol 1e-3`` on lse (``tests/test_mla.py``).
* The MLPs' down projection multiplies the bf16-rounded h (2^-8 relative) in bf16: relative
  Frobenius error ``<= 2^-6`` (fp32: ``1e-4``).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import tilefuse
from tilefuse._registry import FAMILIES
from tilefuse.testing import assert_close, cos_diff, rel_err

HAS_CUDA = torch.cuda.is_available()
MODES = ("static", "dynamic")
TIMEOUT_S = 900


# ------------------------------------------------------------------------------------- checks
def _half(t: torch.Tensor) -> bool:
    """A 16-bit output (the kernels': bf16 on a GPU, fp16 in the interpreter)."""
    return t.dtype in (torch.bfloat16, torch.float16)


def _close(out, ref, *, half_tol=(1e-2, 2 ** -7), fp32_tol=(1e-4, 1e-4), name="out"):
    atol, rtol = half_tol if _half(out) else fp32_tol
    assert_close(out, ref, atol=atol, rtol=rtol, name=name)


def _check_mla(result, ref):
    out, lse = result
    ro, rl = ref
    assert out.shape == ro.shape and lse.shape == rl.shape, (out.shape, lse.shape, ro.shape, rl.shape)
    finite = torch.isfinite(rl)
    assert torch.equal(torch.isinf(lse), ~finite.to(lse.device)), "lse: +inf exactly where a row sees no key"
    if _half(out):
        assert cos_diff(out, ro) < 1e-5
        assert_close(out, ro, atol=1e-2, rtol=1e-2)
        assert_close(lse[finite], rl[finite], atol=1e-3, rtol=1e-4, name="lse")
    else:
        assert_close(out, ro, atol=1e-4, rtol=1e-4)
        assert_close(lse[finite], rl[finite], atol=1e-4, rtol=1e-4, name="lse")


def _check_mlp(out, ref):
    assert out.shape == ref.shape and out.dtype != torch.float64
    assert rel_err(out, ref) <= (2 ** -6 if out.dtype in (torch.bfloat16, torch.float16) else 1e-4)


# ------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class CompileCase:
    """``setup(device, dtype)`` -> ``(fn, [args, args2], check)``: the function or module to
    compile, the inputs of two sizes (the second for ``dynamic=True`` only; built without any
    eager op call) and ``check(output, args)``, which raises on a wrong output. ``public``: the
    public function or ``tilefuse.nn`` module it covers. The graph dynamo captures must call a
    ``torch.ops.tilefuse`` custom op (a public function that bypassed its op under tracing would
    put its implementation's PyTorch calls or kernel launches there instead). ``needs``: on a GPU,
    the ``kernel_status`` entry ``(family, variant)`` that must say "ok" for the case to run."""
    name: str
    public: str
    setup: Callable
    needs: tuple[str, str] | None = None


def _swiglu(device, dt):
    from tilefuse.testing import swiglu as sw

    def args(m):
        return tuple(sw.make_case(m, 64, 96, dt, device, bias=True).args())

    return (lambda x, w, b: tilefuse.swiglu(x, w, b), [args(3), args(5)],
            lambda out, a: _close(out, sw.reference_fp64(*a)))


def _pack_gate_up(device, dt):
    from tilefuse.ops.swiglu.reference import swiglu_reference

    def args(m):
        return (torch.randn(m, 64, device=device).to(dt), (torch.randn(64, 64, device=device) / 8).to(dt),
                (torch.randn(64, 64, device=device) / 8).to(dt))

    def fn(x, wg, wu):
        return tilefuse.pack_gate_up(wg, wu), tilefuse.swiglu(x, tilefuse.pack_gate_up(wg, wu), layout="packed")

    def check(out, a):
        x, wg, wu = a
        packed, h = out
        want = torch.stack((wg.view(1, 64, 64), wu.view(1, 64, 64)), 1).reshape(128, 64)
        assert torch.equal(packed, want)
        ref = swiglu_reference(x.double(), torch.cat((wg, wu)).double(), None, compute_dtype=torch.float64)
        _close(h, ref)

    return fn, [args(3), args(6)], check


def _swiglu_fp8(device, dt):
    from tilefuse.testing import swiglu as sw

    def args(m):
        return tuple(sw.make_fp8_case(m, 256, 128, device).args())

    def check(out, a):
        assert out.dtype == torch.bfloat16
        _close(out, sw.reference_fp8_fp64(sw.SwiGLUFp8Case(*a)), half_tol=(1e-3, 2 ** -7))

    return lambda x, xs, w, ws: tilefuse.swiglu_fp8(x, xs, w, ws), [args(3), args(5)], check


def _swiglu_fp8_e4m3(device, dt):
    from tilefuse.testing import swiglu as sw

    def args(m):
        return tuple(sw.make_fp8_case(m, 256, 128, device).args())

    def check(out, a):
        q, s = out
        ref = sw.reference_fp8_fp64(sw.SwiGLUFp8Case(*a))
        assert q.dtype == torch.float8_e4m3fn and s.shape == (*ref.shape[:-1], ref.shape[-1] // 128)
        # e4m3 keeps 3 mantissa bits: each value within half an ulp, 2^-4 relative, of its group's h
        deq = q.double() * s.double().repeat_interleave(128, -1)
        assert_close(deq, ref, atol=2 ** -4 * ref.abs().max().item() * 2 ** -3, rtol=2 ** -3, name="h")

    return (lambda x, xs, w, ws: tilefuse.swiglu_fp8(x, xs, w, ws, out_dtype=torch.float8_e4m3fn),
            [args(3), args(5)], check)


def _vq_matmul(device, dt):
    from tilefuse.testing import vq as vqc

    weight = vqc.make_case(1, 128, 128, dt, device, bias=True)

    def args(m):
        x = torch.randn(m, 128, device=device).to(dt)
        return x, weight.codes, weight.codebooks, weight.scales, weight.bias

    def check(out, a):
        _close(out, vqc.reference_fp64(vqc.VQCase(*a)))

    return lambda x, c, b, s, bias: tilefuse.vq_matmul(x, c, b, s, bias), [args(3), args(5)], check


def _vq_swiglu(device, dt):
    from tilefuse.ops.vq.reference import vq_swiglu_reference
    from tilefuse.testing import vq as vqc

    gate = vqc.make_case(1, 64, 128, dt, device, bias=True)
    up = vqc.make_case(1, 64, 128, dt, device, bias=True)
    weights = (gate.codes, gate.codebooks, gate.scales, up.codes, up.codebooks, up.scales, gate.bias, up.bias)

    def args(m):
        return (torch.randn(m, 128, device=device).to(dt), *weights)

    def check(out, a):
        x, *w = a
        ref = vq_swiglu_reference(x.double(), w[0], w[1].double(), w[2].double(), w[3], w[4].double(),
                                  w[5].double(), w[6].double(), w[7].double(), compute_dtype=torch.float64)
        _close(out, ref)

    return lambda x, *w: tilefuse.vq_swiglu(x, *w), [args(3), args(5)], check


def _mla_inputs(device, dt, lens, s_q=1, h_q=16, **kw):
    from tilefuse.testing import mla as mc

    return mc.make_case(lens, s_q, h_q, dt, device, **kw)


def _get_mla_metadata(device, dt):
    from tilefuse.ops.mla import op

    def args(b):
        return (torch.tensor([70, 5, 300, 0, 129][:b], dtype=torch.int32, device=device),)

    def check(out, a):
        meta, splits = out
        (lens,) = a
        assert meta.shape == (op.metadata_slots(4, lens.shape[0]), 8) and splits.shape == (lens.shape[0] + 1,)
        op.check_schedule(lens, meta, splits)          # every request's pages covered once, in range

    return (lambda lens: tilefuse.get_mla_metadata(lens, 16, 1, num_sm_parts=4), [args(3), args(5)], check)


def _flash_mla(kind):
    """Dense bf16 / fp32 cache, FP8 cache (FlashMLA's 656-byte layout) or sparse (top-k over an FP8
    cache, a topk_length and a sink)."""

    def setup(device, dt):
        from tilefuse.ops.mla.reference import (dequantize_kv_reference, mla_decode_reference,
                                                mla_sparse_decode_reference, quantize_kv_reference)

        def args(lens):
            inp = _mla_inputs(device, dt, lens, nan_tail=kind == "dense")
            if kind == "dense":
                return inp.args()
            packed = quantize_kv_reference(inp.k_cache)
            if kind == "fp8":
                return inp.q, packed, inp.block_table, inp.cache_seqlens
            gen = torch.Generator().manual_seed(len(lens))
            table = inp.block_table.cpu().long()
            idx = torch.full((len(lens), 1, 64), -1, dtype=torch.int32)
            for i, n in enumerate(lens):
                pos = torch.randperm(n, generator=gen)[:min(n, 60)]
                idx[i, 0, :len(pos)] = (table[i, pos // 64] * 64 + pos % 64).int()
            length = torch.tensor([min(n, 60) for n in lens], dtype=torch.int32)
            sink = torch.randn(inp.q.shape[2], generator=gen)
            return inp.q, packed, idx.to(device), length.to(device), sink.to(device)

        def fn(q, k_cache, block_table, lens, *rest):
            if kind == "sparse":
                return tilefuse.flash_mla_with_kvcache(q, k_cache, None, None, 512, None, None, is_fp8_kvcache=True,
                                                       indices=block_table, topk_length=lens, attn_sink=rest[0])
            meta, splits = tilefuse.get_mla_metadata(lens, q.shape[1] * q.shape[2], 1)
            return tilefuse.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512, meta, splits, causal=True,
                                                   is_fp8_kvcache=kind == "fp8")

        def check(out, a):
            q, cache = a[0], a[1]
            if kind == "sparse":
                ref = mla_sparse_decode_reference(q, cache, a[2], topk_length=a[3], attn_sink=a[4],
                                                  compute_dtype=torch.float64)
            else:
                if kind == "fp8":
                    cache = dequantize_kv_reference(cache, q.dtype)
                ref = mla_decode_reference(q, cache, a[2], a[3], 512, causal=True, compute_dtype=torch.float64)
            _check_mla(out, ref)

        return fn, [args([70, 5, 130]), args([200, 64, 1, 77])], check

    return setup


def _mla_quantize_kv(device, dt):
    from tilefuse.ops.mla.reference import quantize_kv_reference

    def args(t):
        return (torch.randn(t, 576, device=device).to(dt),)

    def check(out, a):
        assert torch.equal(out, quantize_kv_reference(a[0]))

    return lambda latent: tilefuse.mla_quantize_kv(latent), [args(3), args(7)], check


def _mla_dequantize_kv(device, dt):
    from tilefuse.ops.mla.reference import dequantize_kv_reference, quantize_kv_reference

    def args(t):
        return (quantize_kv_reference(torch.randn(t, 1, 576, device=device)),)

    def check(out, a):
        assert torch.equal(out, dequantize_kv_reference(a[0], torch.bfloat16))

    return lambda packed: tilefuse.mla_dequantize_kv(packed, torch.bfloat16), [args(3), args(7)], check


def _mla_scatter_kv(device, dt):
    def args(t):
        cache = torch.zeros(4, 64, 1, 576, dtype=dt, device=device)
        slots = torch.randperm(4 * 64)[:t].to(torch.int64)
        slots[0] = -1                                   # skipped
        return torch.randn(t, 576, device=device).to(dt), cache, slots.to(device)

    def fn(latent, cache, slots):
        tilefuse.mla_scatter_kv(latent, cache, slots)
        return cache

    def check(out, a):
        latent, _, slots = a
        want = torch.zeros(4 * 64, 576, dtype=dt, device=device)
        keep = slots >= 0
        want[slots[keep]] = latent[keep]
        assert torch.equal(out.reshape(-1, 576), want)

    # the cache is written in place: fresh inputs per call (args are built again per size)
    return fn, [args(5), args(9)], check


def _fused_mlp(layout):
    def setup(device, dt):
        from tilefuse.nn import FusedSwiGLUMLP
        from tilefuse.ops.swiglu.op import unpack_gate_up
        from tilefuse.ops.swiglu.reference import swiglu_reference

        mlp = FusedSwiGLUMLP(64, 128, bias=layout == "merged", layout=layout, device=device, dtype=dt)

        def check(out, a):
            w = mlp.gate_up_weight.detach().double()
            if layout == "packed":
                w = torch.cat(unpack_gate_up(w))
            b = None if mlp.gate_up_bias is None else mlp.gate_up_bias.detach().double()
            h = swiglu_reference(a[0].double(), w, b, compute_dtype=torch.float64)
            _check_mlp(out, h @ mlp.down_proj.weight.detach().double().T)

        return mlp, [(torch.randn(3, 64, device=device).to(dt),), (torch.randn(5, 64, device=device).to(dt),)], check

    return setup


def _fused_mlp_fp8(device, dt):
    from torch import nn

    from tilefuse.nn import FusedSwiGLUMLP
    from tilefuse.ops.swiglu_fp8.reference import quantize_fp8, swiglu_fp8_reference

    class MLP(nn.Module):          # the shape of an HF MLP, as from_mlp takes it
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(256, 128, bias=False), nn.Linear(256, 128, bias=False)
            self.down_proj, self.act_fn = nn.Linear(128, 256, bias=False), nn.SiLU()

    mlp = FusedSwiGLUMLP.from_mlp(MLP().to(device=device, dtype=torch.bfloat16), fp8=True)

    def check(out, a):
        xq, xs = quantize_fp8(a[0], mlp.act_group)
        h = swiglu_fp8_reference(xq, xs, mlp.gate_up_weight, mlp.gate_up_scales, out_dtype=torch.float64)
        _check_mlp(out, h @ mlp.down_proj.weight.detach().double().T)

    return mlp, [(torch.randn(3, 256, device=device).to(torch.bfloat16),),
                 (torch.randn(5, 256, device=device).to(torch.bfloat16),)], check


def _vq_moe(device, dt):
    from tilefuse.testing import vq as vqc

    base = vqc.make_moe_case(5, 2, 4, 64, 32, dt, device)
    weights = base.args()[3:]

    def args(t):
        c = vqc.make_moe_case(t, 2, 4, 64, 32, dt, device)
        return (c.x, c.top_k_index, c.top_k_weights, *weights)

    def check(out, a):
        _close(out, vqc.moe_reference_fp64(vqc.MoECase(*a)))

    return lambda *a: tilefuse.vq_moe(*a), [args(3), args(5)], check


def _vq_moe_experts(device, dt):
    from tilefuse.nn import VQMoEExperts
    from tilefuse.testing import vq as vqc

    base = vqc.make_moe_case(1, 2, 4, 64, 32, dt, device)
    experts = VQMoEExperts(4, 64, 32, dtype=dt, device=device)
    for name in ("gate_up_codes", "gate_up_codebooks", "gate_up_scales", "down_codes", "down_codebooks",
                 "down_scales"):
        getattr(experts, name).copy_(getattr(base, name).reshape(getattr(experts, name).shape))

    def args(t):
        c = vqc.make_moe_case(t, 2, 4, 64, 32, dt, device)
        return c.x, c.top_k_index, c.top_k_weights

    def check(out, a):
        _close(out, vqc.moe_reference_fp64(vqc.MoECase(*a, *base.args()[3:])))

    return experts, [args(3), args(5)], check


def _vq_linear(device, dt):
    from tilefuse.nn import VQLinear
    from tilefuse.testing import vq as vqc

    c = vqc.make_case(1, 128, 128, dt, device, bias=True)
    layer = VQLinear(128, 128, dtype=dt, device=device).load_quantized(c.codes, c.codebooks, c.scales, c.bias)

    def check(out, a):
        _close(out, vqc.reference_fp64(vqc.VQCase(a[0], c.codes, c.codebooks, c.scales, c.bias)))

    return layer, [(torch.randn(3, 128, device=device).to(dt),), (torch.randn(5, 128, device=device).to(dt),)], check


def _vq_swiglu_mlp(device, dt):
    from tilefuse.nn import VQLinear, VQSwiGLUMLP
    from tilefuse.ops.vq.reference import vq_swiglu_reference
    from tilefuse.testing import vq as vqc

    gate, up = (VQLinear(128, 64, dtype=dt, device=device).load_quantized(c.codes, c.codebooks, c.scales, c.bias)
                for c in (vqc.make_case(1, 64, 128, dt, device, bias=True) for _ in range(2)))
    down = torch.nn.Linear(64, 128, bias=False, dtype=dt, device=device)
    mlp = VQSwiGLUMLP(gate, up, down)

    def check(out, a):
        h = vq_swiglu_reference(a[0].double(), gate.codes, gate.codebooks.double(), gate.scales.double(), up.codes,
                                up.codebooks.double(), up.scales.double(), gate.bias.double(), up.bias.double(),
                                compute_dtype=torch.float64)
        _check_mlp(out, h @ down.weight.detach().double().T)

    return mlp, [(torch.randn(3, 128, device=device).to(dt),), (torch.randn(5, 128, device=device).to(dt),)], check


def _mla_module(device, dt):
    from tilefuse.nn import MLADecodeAttention
    from tilefuse.testing import mla as mc

    attn = MLADecodeAttention(16)

    def check(out, a):
        _check_mla(out, mc.reference_fp64(mc.MLACase(*a), causal=True))

    return attn, [_mla_inputs(device, dt, [70, 5, 130]).args(), _mla_inputs(device, dt, [200, 64, 1, 77]).args()], check


FP8 = ("swiglu_fp8", "tl")
CASES = [
    CompileCase("swiglu", "swiglu", _swiglu),
    CompileCase("pack_gate_up", "pack_gate_up", _pack_gate_up),       # plain PyTorch, then the op
    CompileCase("swiglu_fp8", "swiglu_fp8", _swiglu_fp8, needs=FP8),
    CompileCase("swiglu_fp8-e4m3-out", "swiglu_fp8", _swiglu_fp8_e4m3, needs=FP8),
    CompileCase("vq_matmul", "vq_matmul", _vq_matmul),
    CompileCase("vq_swiglu", "vq_swiglu", _vq_swiglu),
    CompileCase("vq_moe", "vq_moe", _vq_moe),
    CompileCase("get_mla_metadata", "get_mla_metadata", _get_mla_metadata),
    CompileCase("flash_mla_with_kvcache-dense", "flash_mla_with_kvcache", _flash_mla("dense")),
    CompileCase("flash_mla_with_kvcache-fp8", "flash_mla_with_kvcache", _flash_mla("fp8")),
    CompileCase("flash_mla_with_kvcache-sparse", "flash_mla_with_kvcache", _flash_mla("sparse")),
    CompileCase("mla_quantize_kv", "mla_quantize_kv", _mla_quantize_kv),
    CompileCase("mla_dequantize_kv", "mla_dequantize_kv", _mla_dequantize_kv),
    CompileCase("mla_scatter_kv", "mla_scatter_kv", _mla_scatter_kv),
    CompileCase("FusedSwiGLUMLP", "FusedSwiGLUMLP", _fused_mlp("merged")),
    CompileCase("FusedSwiGLUMLP-packed", "FusedSwiGLUMLP", _fused_mlp("packed")),
    CompileCase("FusedSwiGLUMLP-fp8", "FusedSwiGLUMLP", _fused_mlp_fp8, needs=FP8),
    CompileCase("VQLinear", "VQLinear", _vq_linear),
    CompileCase("VQSwiGLUMLP", "VQSwiGLUMLP", _vq_swiglu_mlp),
    CompileCase("VQMoEExperts", "VQMoEExperts", _vq_moe_experts),
    CompileCase("MLADecodeAttention", "MLADecodeAttention", _mla_module),
]


def public_names() -> set[str]:
    """Every public function of every family and every ``tilefuse.nn`` module."""
    import tilefuse.nn

    return {name for family in FAMILIES.values() for name in family.public} | set(tilefuse.nn.__all__)


# ------------------------------------------------------------------------------------- running
def fresh() -> None:
    """As close to a new process as one can get in this one: dynamo's caches, every op's call plans
    and every ``functools`` cache of the loaded tilefuse modules cleared."""
    from tilefuse._library import PlanCache

    torch._dynamo.reset()
    for name, module in list(sys.modules.items()):
        if not name.startswith("tilefuse") or module is None:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, PlanCache):
                value.clear()
            elif isinstance(value, functools._lru_cache_wrapper) and getattr(value, "__module__", "") == name:
                value.cache_clear()


def run_case(case: CompileCase, mode: str, device: torch.device, dt: torch.dtype) -> dict:
    """Compile ``case`` in a fresh state and check its outputs; ``{"name", "ok", "error"}``."""
    if device.type == "cuda" and case.needs is not None:
        import importlib

        family, variant = case.needs
        status = importlib.import_module(FAMILIES[family].op_module).kernel_status(device)[variant]
        if not status.startswith("ok"):
            return {"name": case.name, "ok": True, "skipped": status}
    try:
        torch.manual_seed(0)
        fn, inputs, check = case.setup(device, dt)
        fresh()
        graphs = []
        inner = torch._dynamo.lookup_backend("inductor" if device.type == "cuda" else "aot_eager")

        def backend(gm, example_inputs):          # records what dynamo captured, then compiles it
            graphs.append(gm)
            return inner(gm, example_inputs)

        compiled = torch.compile(fn, fullgraph=True, dynamic=mode == "dynamic", backend=backend)
        with torch.no_grad():
            for args in inputs[:2 if mode == "dynamic" else 1]:
                check(compiled(*args), args)
        called = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
        if mode == "dynamic" and len(graphs) > 1:
            raise AssertionError(f"dynamic=True compiled {len(graphs)} graphs for the two input sizes: the second "
                                 f"size recompiled (a size was specialized while tracing; TORCH_LOGS=recompiles "
                                 f"names the guard)")
        if not any(target.startswith("tilefuse.") for target in called):
            raise AssertionError(f"the captured graph calls no torch.ops.tilefuse op (the public function "
                                 f"bypassed its custom op under tracing); it calls {sorted(called)[:12]}")
        return {"name": case.name, "ok": True, "graphs": len(graphs)}
    except Exception as exc:
        tail = traceback.format_exc().strip().splitlines()[-6:]
        return {"name": case.name, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:1500]}",
                "where": "\n".join(tail)}


def main(argv: list[str]) -> int:
    """``MODE DEVICE BACKEND [CASE ...]``: BACKEND ``reference`` (fp32 inputs) or ``triton`` (bf16 on a
    GPU; fp16 in the CPU interpreter, which ``TRITON_INTERPRET=1`` must have enabled)."""
    mode, device, backend = argv[0], torch.device(argv[1]), argv[2]
    names = argv[3:] or [case.name for case in CASES]
    dt = torch.float32 if backend == "reference" else torch.bfloat16 if device.type == "cuda" else torch.float16
    with tilefuse.force(backend=backend):
        for case in CASES:
            if case.name in names:
                print(json.dumps(run_case(case, mode, device, dt)), flush=True)
    return 0


@functools.lru_cache(maxsize=None)
def _runners(device: str, backend: str) -> dict:
    """This file as a script, one process per mode for ``device`` and ``backend``, all started at
    once (the modes' compiles overlap): mode -> its process."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if device == "cpu" and backend == "triton":
        env["TRITON_INTERPRET"] = "1"             # before tilefuse (and @triton.jit) is imported
    runners = {mode: subprocess.Popen([sys.executable, str(Path(__file__).resolve()), mode, device, backend],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                      cwd=Path(__file__).resolve().parents[1])
               for mode in MODES}
    for process in runners.values():       # a mode no selected test reads is not left running
        atexit.register(process.kill)
    return runners


@functools.lru_cache(maxsize=None)
def _results(mode: str, device: str, backend: str) -> dict:
    """case name -> its result, from the mode's process."""
    process = _runners(device, backend)[mode]
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
    results = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            results[row["name"]] = row
    if not results:
        raise AssertionError(f"the compile runner gave nothing (exit {process.returncode}): {stderr[-3000:]}")
    results["_stderr"] = stderr[-3000:]
    return results


def _assert_case(mode: str, device: str, backend: str, name: str) -> None:
    results = _results(mode, device, backend)
    row = results.get(name)
    assert row is not None, f"{name}: no result (the runner stopped before it): {results['_stderr']}"
    if row.get("skipped"):
        pytest.skip(row["skipped"])
    assert row["ok"], f"{name} ({mode}, {device}, {backend}): {row['error']}\n{row.get('where', '')}"


# ------------------------------------------------------------------------------------- tests
def test_every_public_op_and_module_has_a_compile_case():
    covered = {case.public for case in CASES}
    assert public_names() <= covered, f"no torch.compile case for {sorted(public_names() - covered)}"
    assert covered <= public_names(), f"cases of names that are not public: {sorted(covered - public_names())}"
    assert len({case.name for case in CASES}) == len(CASES)


def test_fresh_clears_the_plan_caches():
    from tilefuse.ops.swiglu import op
    from tilefuse.testing import swiglu as sw

    with tilefuse.force(backend="reference"):
        tilefuse.swiglu(*sw.make_case(2, 16, 8, torch.float32, "cpu").args())
    assert len(op._plans) > 0
    fresh()
    assert len(op._plans) == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", [case.name for case in CASES])
def test_compile_cpu_reference(mode, name):
    """CPU: the reference backend, compiled with aot_eager before any eager call."""
    _assert_case(mode, "cpu", "reference", name)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", [case.name for case in CASES])
def test_compile_cpu_interpreted_kernels(mode, name):
    """CPU: the Triton kernels in the interpreter (fp16): the kernel path's Python (plans,
    configs, the dispatch's tables) traced as on a GPU."""
    _assert_case(mode, "cpu", "triton", name)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", [case.name for case in CASES])
def test_compile_gpu(mode, name):
    """GPU: the kernels as dispatched, compiled with Inductor before any eager call."""
    _assert_case(mode, "cuda", "triton", name)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
