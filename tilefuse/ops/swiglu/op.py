"""``tilefuse.swiglu`` and ``tilefuse.pack_gate_up``: validation, launch plans, dispatch, custom op.

Kernels live in ``kernels.py`` (Triton) and ``kernels_gluon.py`` (Gluon, Hopper), the
configuration table and the cost model in ``configs.py``, the spec in ``reference.py``. Dispatch:
``configs.choose(M, H, I)`` picks the small-M (split-K, pointer), the large-M (persistent, TMA) or
the ping-pong (Gluon, warp-specialized) kernel and its tiles, or the unfused path (cuBLAS's GEMM
on the merged weight + one SiLU·mul pass) where no kernel is measured or predicted faster;
``tilefuse.force(variant=...)`` pins ``"small_m"``, ``"large_m"``, ``"pingpong"`` or ``"unfused"``;
``tilefuse.explain(tilefuse.swiglu, x, w)`` says which runs and why. The ping-pong kernel needs an sm_90 GPU: elsewhere
(the interpreter, other GPUs, TMA-unaligned tensors) its calls run the large-M kernel. fp16/bf16
run the kernels on CUDA; fp32/fp64 run the reference (cuBLAS GEMMs on a GPU) on every device.

Cost of an eager call: argument checks run once per argument layout (shapes, dtypes, strides,
devices), the (variant, config, grid) plan once per problem size, and the launch goes straight to
the compiled kernel (``tilefuse._launch``). Split-K and stream-K tickets come from
``tilefuse._scratch`` (per stream, or per captured call), so concurrent streams never share them.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from tilefuse import _checks, _dispatch, _launch, _scratch
from tilefuse._backend import VARIANTS as _FAMILY_VARIANTS
from tilefuse._backend import check_interpretable, choose_backend, forced_variant, gluon_hopper, interpreting
from tilefuse._backend import num_sms as device_num_sms
from tilefuse._library import PlanCache, plan_key, tilefuse_op, use_dispatcher
from tilefuse.ops.swiglu import configs
from tilefuse.ops.swiglu.reference import swiglu_reference

LAYOUTS = ("merged", "packed")
VARIANTS = _FAMILY_VARIANTS["swiglu"]
KERNEL_DTYPES = _checks.FLOAT16S     # fp32 / fp64 inputs run the reference
PACK = configs.PACK


# ----------------------------------------------------------------------------- packed layout
def pack_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """Interleave gate and up weights into the block layout of ``layout="packed"``.

    Parameters
    ----------
    w_gate, w_up : [I, H] bf16 or fp16 (fp32 and fp64 accepted too; same dtype, device); I a multiple
        of 64, H of 8.

    Returns
    -------
    [2I, H], contiguous: for each block b = 0 .. I/64 - 1, the 64 gate rows ``w_gate[64b:64b+64]``
    followed by the 64 matching up rows ``w_up[64b:64b+64]``. Row ``128 b + j`` is gate row
    ``64 b + j`` and row ``128 b + 64 + j`` is up row ``64 b + j``. One GEMM tile of ``2 * 64 k``
    weight rows therefore holds matching gate and up columns, and the large-M kernel feeds them to
    the tensor cores as a single dot.
    """
    _checks.check_tensor("w_gate", w_gate, dtypes=_checks.FLOATS, ndim=2)
    _checks.check_tensor("w_up", w_up, dtypes=(w_gate.dtype,), ndim=2)
    _checks.check_shape("w_up", w_up, tuple(w_gate.shape), f"[I, H] = {tuple(w_gate.shape)} like w_gate")
    _checks.check_same_device(w_gate=w_gate, w_up=w_up)
    inter, hidden = w_gate.shape
    _checks.check_multiple("w_gate", inter, PACK, "I (rows) for the packed layout")
    _checks.check_multiple("w_gate", hidden, 8, "H (columns)")
    blocks = inter // PACK
    return torch.stack((w_gate.reshape(blocks, PACK, hidden), w_up.reshape(blocks, PACK, hidden)),
                       dim=1).reshape(2 * inter, hidden).contiguous()


def unpack_gate_up(w_packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_gate_up`: ``[2I, H]`` packed -> (w_gate ``[I, H]``, w_up ``[I, H]``)."""
    rows, hidden = w_packed.shape
    pairs = w_packed.reshape(rows // (2 * PACK), 2, PACK, hidden)
    return pairs[:, 0].reshape(rows // 2, hidden), pairs[:, 1].reshape(rows // 2, hidden)


# ----------------------------------------------------------------------------- launchers
@functools.cache
def _kernels():
    from tilefuse.ops.swiglu import kernels

    return _launch.Kernel(kernels.swiglu_small_m_kernel), _launch.Kernel(kernels.swiglu_large_m_kernel)


@functools.cache
def _silu_mul_kernel():
    from tilefuse.ops.swiglu import kernels

    return _launch.Kernel(kernels.silu_mul_kernel)


def run_unfused(x2d: torch.Tensor, w: torch.Tensor, bias, out: torch.Tensor, packed: bool) -> torch.Tensor:
    """The unfused path the dispatch keeps as a candidate: ``y = x2d @ w^T`` by cuBLAS
    (``[M, 2I]``, x's dtype), then one pass ``out = silu(y_gate + b_gate) * (y_up + b_up)`` (bias
    and SiLU in fp32, one rounding; y itself is rounded once more than in the fused kernels, as in
    the two-GEMM code this path stands for). The GEMM goes through ``_scratch.blas``: captured into
    a CUDA graph, it gets a cuBLAS workspace of that graph's own."""
    return silu_mul(_scratch.blas(torch.nn.functional.linear, x2d, w), out, bias, packed)


def silu_mul(y: torch.Tensor, out: torch.Tensor, bias=None, packed: bool = False,
             out_scales: torch.Tensor | None = None) -> torch.Tensor:
    """The SiLU·mul pass of the unfused paths: ``out [M, I] = silu(y_gate (+ b)) * (y_up (+ b))``
    from a GEMM's ``y [M, 2I]`` (unit last stride; merged or ``packed`` gate/up columns), in fp32
    with one rounding to ``out``'s dtype; with ``out_scales [M, I/128]`` fp32 (the FP8 pipeline),
    ``out`` holds e4m3 codes re-quantized per row and 128 columns (or their fp32 quotients in the
    interpreter). Returns ``out``."""
    m, inter = out.shape
    quant = out_scales is not None
    grid, scalars, key, meta = _silu_mul_plan(y.device, m, inter, y.stride(0), out.stride(0),
                                              out_scales.stride(0) if quant else 0, y.dtype, out.dtype, packed,
                                              bias is not None, quant)
    _silu_mul_kernel().launch((key, _launch.aligned(y, bias, out, out_scales)), grid, y.device.index,
                              (y, bias if bias is not None else y, out, out_scales if quant else y), scalars, meta)
    return out


@functools.lru_cache(maxsize=1024)
def _silu_mul_plan(device, m, inter, stride_y, stride_out, stride_os, y_dtype, out_dtype, packed, has_bias, quant):
    """The SiLU·mul pass's launch for one size: grid, run-time scalars, the launch key's part that
    depends on the size (what Triton specializes on: dtypes, constexprs, integers equal to 1 or
    multiples of 16; the pointers' alignment is added per call) and the meta-parameters."""
    # one row per program up to 64 rows (a 16-row block left decode-sized M on a handful of SMs);
    # an e4m3 output takes one 128-column group per program row
    block_m, block_n = (1 if m <= 64 else 16), (128 if quant else 256)
    grid = (triton_cdiv(inter, block_n), triton_cdiv(m, block_m), 1)
    scalars = (m, inter, stride_y, stride_out, stride_os)
    key = (device, y_dtype, out_dtype, packed, has_bias, quant, block_m, _launch.specialized(*scalars))
    meta = dict(HAS_BIAS=has_bias, PACKED=packed, PACK=PACK, QUANT_OUT=quant, BLOCK_M=block_m, BLOCK_N=block_n,
                num_warps=4)
    return grid, scalars, key, meta


def _pingpong_kernel():
    """The Gluon kernel's launcher, or None where Triton has no Gluon Hopper module."""
    return _launch.optional_kernel("tilefuse.ops.swiglu.kernels_gluon", "swiglu_pingpong_kernel")


def pingpong_usable(device: torch.device) -> bool:
    """The ping-pong kernel runs on ``device``: an sm_90 GPU (WGMMA) and Gluon's Hopper module."""
    return gluon_hopper(device) and _pingpong_kernel() is not None


def _tma_ok(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)


def launch_large_m(x: torch.Tensor, w: torch.Tensor, bias, out: torch.Tensor, packed: bool,
                   cfg: configs.LargeMConfig, num_sms: int | None = None) -> torch.Tensor:
    """x: [M, H] (unit last stride), w: [2I, H] contiguous, out: [M, I]; x, w and out must be
    16-byte aligned (TMA).
    ``num_sms`` (default: the device's) sizes the persistent grid; tests shrink it to mix the
    data-parallel and the stream-K parts on small shapes."""
    m, h = x.shape
    inter = w.shape[0] // 2
    if packed and cfg.block_n % PACK:
        raise ValueError(f"config: packed layout needs block_n a multiple of {PACK}, got {cfg.block_n}")
    x_desc = _launch.descriptor(x, x.shape, x.stride(), [cfg.block_m, cfg.block_k])
    if packed:
        w_desc = _launch.descriptor(w, [2 * inter, h], [w.stride(0), 1], [2 * cfg.block_n, cfg.block_k])
    else:  # [2, I, H] view: one box holds the gate and the up rows of a tile
        w_desc = _launch.descriptor(w, [2, inter, h], [inter * w.stride(0), w.stride(0), 1],
                                    [2, cfg.block_n, cfg.block_k])
    out_desc = _launch.descriptor(out, out.shape, out.stride(), [cfg.block_m, cfg.block_n])
    num_sms = num_sms or device_num_sms(x.device)
    tiles = triton_cdiv(m, cfg.block_m) * triton_cdiv(inter, cfg.block_n)
    sk_tiles, sk_iters = configs.stream_k_split(m, h, inter, cfg, num_sms)
    grid = (num_sms if sk_tiles else min(num_sms, tiles),)
    if sk_tiles:  # partials: [program, first|last piece of its K run, gate|up, BLOCK_M, BLOCK_N]
        (ws,) = _scratch.workspace(x.device, (num_sms * 2 * 2 * cfg.block_m * cfg.block_n, torch.float32))
        (locks,) = _scratch.zeroed(x.device, (sk_tiles, torch.int32))
    else:
        ws = locks = out  # unused
    key = (x.device, x.dtype, m, inter, h, bias is not None, packed, cfg, grid, sk_tiles > 0,
           _launch.aligned(bias))
    _kernels()[1](
        key, grid, x.device.index,
        x_desc, w_desc, out_desc, bias if bias is not None else w, ws, locks,
        m, inter, h, sk_tiles, sk_iters, 0.0,
        HAS_BIAS=bias is not None, PACKED=packed, PACK=PACK,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, NUM_SMS=grid[0], WARP_SPECIALIZE=cfg.warp_specialize and x.is_cuda,
        STREAM_K=sk_tiles > 0, PROMOTE=cfg.promote,
        num_stages=cfg.num_stages, num_warps=cfg.num_warps,
    )
    return out


def launch_pingpong(x: torch.Tensor, w: torch.Tensor, bias, out: torch.Tensor, packed: bool,
                    cfg: configs.PingPongConfig) -> torch.Tensor:
    """x: [M, H] (unit last stride), w: [2I, H] contiguous, out: [M, I]; bf16 or fp16, all three
    16-byte aligned with 16-byte row strides (TMA). One persistent program per SM (fewer when the
    tiles are fewer)."""
    m, h = x.shape
    inter = w.shape[0] // 2
    if packed and cfg.block_n % PACK:
        raise ValueError(f"config: packed layout needs block_n a multiple of {PACK}, got {cfg.block_n}")
    chunk = PACK if packed else cfg.block_n

    def desc(t, rows, cols, stride, block):
        return _launch.descriptor(t, [rows, cols], [stride, 1], block, gluon=True)

    x_desc = desc(x, m, h, x.stride(0), [cfg.block_m, cfg.block_k])
    w_desc = desc(w, 2 * inter, h, w.stride(0), [chunk, cfg.block_k])
    out_desc = desc(out, m, inter, out.stride(0), [cfg.block_m, cfg.block_n])
    tiles = triton_cdiv(m, cfg.block_m) * triton_cdiv(inter, cfg.block_n)
    grid = (min(device_num_sms(x.device), tiles), 1, 1)
    key = (x.device, x.dtype, m, inter, h, bias is not None, packed, cfg, grid, _launch.aligned(bias))
    _pingpong_kernel().launch(
        key, grid, x.device.index, (x_desc, w_desc, out_desc, bias if bias is not None else w), (m, inter, h),
        dict(HAS_BIAS=bias is not None, PACKED=packed, CHUNK=chunk, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
             BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, STAGES=cfg.stages, NUM_SMS=grid[0], num_warps=4))
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=4096)
def plan(m: int, h: int, inter: int, device: torch.device, variant: str | None):
    """(variant, config) the op runs for an ``[m, h] x [2 inter, h]`` problem (cached per size);
    the ping-pong kernel's choice becomes the large-M kernel's where the Gluon kernel cannot run."""
    num_sms = device_num_sms(device, cpu_default=configs.NUM_SMS_H200)
    chip, gpu = _dispatch.chip(device), _dispatch.gpu_name(device)
    variant, config = configs.choose(m, h, inter, variant, num_sms, chip, gpu)
    if variant == "pingpong" and not pingpong_usable(device):
        return "large_m", configs.choose(m, h, inter, "large_m", num_sms, chip, gpu)[1]
    return variant, config


def explain(x: torch.Tensor, w_gate_up: torch.Tensor, bias: torch.Tensor | None = None, *,
            layout: str = "merged") -> _dispatch.Choice:
    """The decision ``swiglu(x, w_gate_up, bias, layout=layout)`` runs, with every candidate the
    dispatch weighed and its predicted time (``tilefuse.explain``)."""
    _validate(x, w_gate_up, bias, layout)
    hidden, inter = x.shape[-1], w_gate_up.shape[0] // 2
    m = x.numel() // hidden if hidden else 0
    problem = {"M": m, "H": hidden, "I": inter, "dtype": str(x.dtype).removeprefix("torch."), "device": str(x.device)}
    if x.dtype not in KERNEL_DTYPES or m == 0 or inter == 0 or choose_backend(x.device) != "triton":
        return _dispatch.Choice("swiglu", problem, "reference", None, "reference: " + (
            "PyTorch computes this dtype" if x.dtype not in KERNEL_DTYPES else "empty problem" if not m * inter
            else f"backend for {x.device.type} tensors"))
    num_sms = device_num_sms(x.device, cpu_default=configs.NUM_SMS_H200)
    forced = forced_variant("swiglu")
    variant, config = plan(m, hidden, inter, x.device, forced)
    decision = configs.decision(m, hidden, inter, num_sms, _dispatch.chip(x.device), _dispatch.gpu_name(x.device))
    source = "forced" if forced else decision.source
    if variant != decision.variant and not forced:
        source += f"; {decision.variant} cannot run here"
    return dataclasses.replace(decision, problem=problem, variant=variant, config=config, source=source)


def run_kernel(x2d: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, layout: str = "merged",
               variant: str | None = None, config=None, out: torch.Tensor | None = None,
               num_sms: int | None = None) -> torch.Tensor:
    """Run the Triton kernels on a 2-D problem (tests, tuning): ``x2d [M, H] -> out [M, I]``.

    ``variant``/``config`` pin the kernel and its tiles (``None``: the op's own choice; a
    ``"pingpong"`` pin runs the large-M kernel where the Gluon kernel cannot run); ``out``
    (``[M, I]``, unit last stride) receives the result when given; ``num_sms`` overrides the
    large-M kernel's grid size (tests).
    """
    m, h = x2d.shape
    inter = w.shape[0] // 2
    if out is None:
        out = torch.empty((m, inter), dtype=x2d.dtype, device=x2d.device)
    if m == 0:
        return out
    if config is None:
        variant, config = plan(m, h, inter, x2d.device, variant)
    elif variant is None:
        variant = configs.variant_of(config)
    packed = layout == "packed"
    if variant == "unfused":
        return run_unfused(x2d, w, bias, out, packed)
    if variant == "pingpong" and not pingpong_usable(x2d.device):
        variant, config = "large_m", configs.choose(m, h, inter, "large_m")[1]
    if variant in ("large_m", "pingpong"):
        if packed and config.block_n % PACK:   # whole packed blocks per tile
            config = dataclasses.replace(config, block_n=128 if variant == "large_m" else PACK)
        if not _tma_ok(x2d, w, out):
            x2d = x2d.contiguous() if x2d.data_ptr() % 16 == 0 else x2d.clone()
            if not _tma_ok(x2d, w, out):  # an unaligned `out`: compute aside, then copy
                return out.copy_(run_kernel(x2d, w, bias, layout, variant, config, num_sms=num_sms))
        if variant == "pingpong":
            return launch_pingpong(x2d, w, bias, out, packed, config)
        return launch_large_m(x2d, w, bias, out, packed, config, num_sms)
    call = _small_m_call(m, h, inter, x2d.stride(0), out.stride(0), w.stride(0), config, bias is not None, packed)
    return _launch_small_m(call, x2d, w, bias, out)


# ----------------------------------------------------------------------------- status, custom op
def kernel_status(device: torch.device) -> dict[str, str]:
    """Which SwiGLU kernel variants run on ``device`` ("ok" or why not)."""
    from tilefuse._backend import triton_available

    usable, why = triton_available()
    if not usable:
        return {v: why for v in VARIANTS}
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        large = "ok" if major >= 9 else f"needs sm_90+ (TMA), this GPU is sm_{major}{minor}"
        pingpong = ("ok" if pingpong_usable(device) else
                    "needs Gluon's Hopper module (triton.experimental.gluon)" if major == 9 else
                    f"needs sm_90 (WGMMA), this GPU is sm_{major}{minor}: runs the large-M kernel")
        return {"small_m": "ok", "large_m": large, "pingpong": pingpong,
                "unfused": "ok (cuBLAS GEMM + SiLU*mul pass: the baseline candidate)"}
    if interpreting():
        return {"small_m": "ok (interpreter)", "large_m": "ok (interpreter, no warp specialization)",
                "pingpong": "GPU only: runs the large-M kernel in the interpreter",
                "unfused": "ok (PyTorch GEMM + the SiLU*mul pass in the interpreter)"}
    return {v: "no CUDA GPU: reference path (TRITON_INTERPRET=1 interprets the kernels)" for v in VARIANTS}


def _reference(x, w_gate_up, bias, layout):
    if layout == "packed":
        w_gate, w_up = unpack_gate_up(w_gate_up)
        w_gate_up = torch.cat((w_gate, w_up))
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    return swiglu_reference(x, w_gate_up, bias, compute_dtype=compute)


def _swiglu_fake(x, w_gate_up, bias, layout):
    return x.new_empty(*x.shape[:-1], w_gate_up.shape[0] // 2)


def _setup_backward(ctx, inputs, output):
    x, w_gate_up, bias, layout = inputs
    ctx.save_for_backward(x, w_gate_up, bias)
    ctx.layout = layout


def _swiglu_backward(ctx, grad_out):
    """Gradients of ``h = silu(g) * u`` with ``g = x Wg^T + bg``, ``u = x Wu^T + bu`` (recomputed in
    fp32, or fp64 for fp64 inputs): ``dg = dh u silu'(g)``, ``du = dh silu(g)``; then
    ``dx = [dg, du] W``, ``dW = [dg, du]^T x``, ``db = sum [dg, du]``. PyTorch GEMMs: through
    ``_scratch.blas`` (a cuBLAS workspace per captured graph)."""
    return _scratch.blas(_backward_gemms, grad_out, ctx)


def _backward_gemms(grad_out, ctx):
    x, w_gate_up, bias = ctx.saved_tensors
    packed = ctx.layout == "packed"
    w = torch.cat(unpack_gate_up(w_gate_up)) if packed else w_gate_up
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    inter = w.shape[0] // 2
    x2d = x.reshape(-1, x.shape[-1]).to(compute)
    pre = x2d @ w.to(compute).T
    if bias is not None:
        pre = pre + bias.to(compute)
    gate, up = pre[:, :inter], pre[:, inter:]
    sig = torch.sigmoid(gate)
    dh = grad_out.reshape(-1, inter).to(compute)
    d_pre = torch.cat((dh * up * sig * (1 + gate * (1 - sig)), dh * gate * sig), dim=1)    # [M, 2I]
    dx = dw = db = None
    if ctx.needs_input_grad[0]:
        dx = (d_pre @ w.to(compute)).reshape(x.shape).to(x.dtype)
    if ctx.needs_input_grad[1]:
        dw = (d_pre.T @ x2d).to(w_gate_up.dtype)
        if packed:
            dw = pack_gate_up(dw[:inter], dw[inter:])
    if bias is not None and ctx.needs_input_grad[2]:
        db = d_pre.sum(0).to(bias.dtype)
    return dx, dw, db, None


@tilefuse_op("swiglu", fake=_swiglu_fake, backward=_swiglu_backward, setup_context=_setup_backward)
def _swiglu_op(x: torch.Tensor, w_gate_up: torch.Tensor, bias: torch.Tensor | None, layout: str) -> torch.Tensor:
    return _run(_plan_call(x, w_gate_up, bias, layout), x, w_gate_up, bias, layout)


class _Call:
    """What a call with one argument layout runs, worked out once (validation included): the
    backend and, for the kernels, the output shape, variant, config and -- on the small-M path --
    the grid, scalar arguments and constexprs of the launch. Identity-hashed: it is the launch's
    plan key (with the pointers' alignment)."""

    __slots__ = ("reference", "out_shape", "m", "variant", "config", "grid", "scalars", "meta", "workspace", "locks")


_plans = PlanCache()


def _plan_call(x, w_gate_up, bias, layout) -> _Call:
    key = plan_key(x, w_gate_up, bias)
    key = key + (layout,) if key is not None and isinstance(layout, str) else None
    call = _plans.get(key) if key is not None else None
    if call is not None:
        return call
    _validate(x, w_gate_up, bias, layout)
    hidden, inter = x.shape[-1], w_gate_up.shape[0] // 2
    if (x.dtype not in KERNEL_DTYPES or hidden == 0 or inter == 0 or choose_backend(x.device) != "triton"):
        call = _Call()
        call.reference = True
        return _plans.remember(key, call)
    check_interpretable("x", x.dtype)
    m = x.numel() // hidden
    variant, config = plan(m, hidden, inter, x.device, forced_variant("swiglu")) if m else (None, None)
    if variant == "small_m":   # x and out rows contiguous: strides H and I
        call = _small_m_call(m, hidden, inter, hidden, inter, w_gate_up.stride(0), config, bias is not None,
                             layout == "packed")
    else:
        call = _Call()
        call.m, call.variant, call.config = m, variant, config
    call.reference = False
    call.out_shape = (*x.shape[:-1], inter)
    return _plans.remember(key, call)


def _small_m_call(m, hidden, inter, stride_xm, stride_om, stride_wn, cfg: configs.SmallMConfig, has_bias: bool,
                  packed: bool) -> _Call:
    """The small-M kernel's launch: one program per [BLOCK_M, BLOCK_N] output tile and K slice."""
    call = _Call()
    call.m, call.variant, call.config = m, "small_m", cfg
    call.grid = (triton_cdiv(inter, cfg.block_n), triton_cdiv(m, cfg.block_m), cfg.split_k)
    # split-K: fp32 partials [SPLIT_K, 2, M, I] (written before read) and one zeroed ticket per tile
    call.workspace = cfg.split_k * 2 * m * inter if cfg.split_k > 1 else 0
    call.locks = call.grid[0] * call.grid[1] if cfg.split_k > 1 else 0
    call.scalars = (m, inter, hidden, stride_xm, stride_wn, stride_om, 0.0)
    call.meta = dict(HAS_BIAS=has_bias, PACKED=packed, PACK=PACK, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                     BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, EVEN_K=hidden % cfg.block_k == 0,
                     PROMOTE=cfg.promote, MASK_ROWS=m % cfg.block_m != 0,
                     num_stages=cfg.num_stages, num_warps=cfg.num_warps)
    return call


def _launch_small_m(call: _Call, x, w, bias, out) -> torch.Tensor:
    if call.locks:
        (ws,) = _scratch.workspace(x.device, (call.workspace, torch.float32))
        (locks,) = _scratch.zeroed(x.device, (call.locks, torch.int32))
    else:
        ws = locks = out   # unused
    key = (call, x.data_ptr() % 16, w.data_ptr() % 16, bias is None or bias.data_ptr() % 16, out.data_ptr() % 16)
    _kernels()[0].launch(key, call.grid, x.device.index,
                         (x, w, bias if bias is not None else w, out, ws, locks), call.scalars, call.meta)
    return out


def _run(call: _Call, x, w_gate_up, bias, layout) -> torch.Tensor:
    if call.reference:   # cuBLAS GEMMs on a GPU: a workspace per captured graph (_scratch.blas)
        return _scratch.blas(_reference, x, w_gate_up, bias, layout)
    out = torch.empty(call.out_shape, dtype=x.dtype, device=x.device)
    if call.m == 0:
        return out
    if not x.is_contiguous():
        x = x.contiguous()
    if call.variant == "small_m":   # decode sizes: the rows of x and out as they lie, no reshapes
        return _launch_small_m(call, x, w_gate_up, bias, out)
    m, hidden = call.m, x.shape[-1]
    run_kernel(x.view(m, hidden), w_gate_up, bias, layout, call.variant, call.config,
               out=out.view(m, call.out_shape[-1]))
    return out


def _validate(x, w_gate_up, bias, layout) -> None:
    _checks.check_tensor("x", x, dtypes=_checks.FLOATS, min_ndim=1)
    _checks.check_tensor("w_gate_up", w_gate_up, dtypes=(x.dtype,), ndim=2)
    _checks.check_choice("layout", layout, LAYOUTS)
    hidden = x.shape[-1]
    _checks.check_shape("w_gate_up", w_gate_up, (None, hidden), f"[2I, H={hidden}]")
    if x.dtype in KERNEL_DTYPES:   # the kernels' vector widths (the reference takes any size)
        _checks.check_multiple("x", hidden, 8, "H (last dimension)")
        _checks.check_multiple("w_gate_up", w_gate_up.shape[0], 16, "2I (rows; I a multiple of 8)")
    else:
        _checks.check_multiple("w_gate_up", w_gate_up.shape[0], 2, "2I (rows)")
    if layout == "packed":
        _checks.check_multiple("w_gate_up", w_gate_up.shape[0], 2 * PACK,
                               "2I (rows) for layout='packed' (I a multiple of 64)")
    if bias is not None:
        _checks.check_tensor("bias", bias, dtypes=(x.dtype,), ndim=1)
        _checks.check_shape("bias", bias, (w_gate_up.shape[0],), f"[2I={w_gate_up.shape[0]}]")
        _checks.check_contiguous("bias", bias)
    _checks.check_same_device(x=x, w_gate_up=w_gate_up, bias=bias)
    _checks.check_contiguous("w_gate_up", w_gate_up)


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, bias: torch.Tensor | None = None, *,
           layout: str = "merged") -> torch.Tensor:
    """Fused ``silu(x @ Wg^T + bg) * (x @ Wu^T + bu)``; the ``[M, 2I]`` intermediate never reaches HBM.

    Parameters
    ----------
    x : [..., H] bf16 or fp16 (the kernels; H a multiple of 8), or fp32 / fp64 (computed by the
        PyTorch reference, cuBLAS on a GPU). Any leading shape, M = their product, M = 0 and H = 0
        allowed.
    w_gate_up : [2I, H], x's dtype, contiguous. ``layout="merged"``: vLLM's layout, the I gate rows
        then the I up rows. ``layout="packed"``: the output of :func:`pack_gate_up`
        (64-row gate/up blocks; I a multiple of 64). I a multiple of 8 for bf16/fp16.
    bias : [2I] or None, x's dtype: the I gate biases then the I up biases (this merged order for
        both layouts).
    layout : "merged" or "packed".

    Returns
    -------
    [..., I] in x's dtype. The fused kernels compute SiLU in fp32 on the fp32 accumulator and round
    once. Where the dispatch keeps the unfused path (``tilefuse.explain`` says when: sizes no
    kernel is measured or predicted faster on), gate and up are rounded to x's dtype by the GEMM
    first, as the two-GEMM code it replaces rounds them; SiLU * mul is then fp32, one rounding.
    Differentiable in ``x``, ``w_gate_up`` and ``bias`` (the backward recomputes the projections in
    fp32 with PyTorch).

    Examples
    --------
    >>> w = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])      # [2I, H]
    >>> h = tilefuse.swiglu(x, w)                                       # [..., I]
    >>> y = h @ mlp.down_proj.weight.T
    """
    if torch.compiler.is_compiling():
        # traced: argument checks only (metadata); the op plans when it runs, outside tracing, so
        # tracing reads no tuned table from disk and does not trace the cost model
        _validate(x, w_gate_up, bias, layout)
        return _swiglu_op(x, w_gate_up, bias, layout)
    call = _plan_call(x, w_gate_up, bias, layout)
    if use_dispatcher(x, w_gate_up, bias):
        return _swiglu_op(x, w_gate_up, bias, layout)
    return _run(call, x, w_gate_up, bias, layout)
