"""``tilefuse.swiglu_fp8``: validation, launch plan, custom op.

The kernels live in ``kernels.py`` (``tl``: the tiled kernel, and the split-K ``decode`` kernel
that serves M <= 16) and ``kernels_gluon.py`` (Gluon, warp-specialized, sm_90, the default from
M = 17 where the table says so; ``tilefuse.force(variant="ws")`` pins it, elsewhere the pin runs
the ``tl`` kernel), the tile choice in ``configs.py``, the spec and the e4m3 quantizers in
``reference.py``. e4m3 inputs on CUDA (sm_90+: TMA, FP8 WGMMA) run a kernel; on other devices the
reference computes in fp32 (``TRITON_INTERPRET=1`` interprets the ``tl`` kernels on CPU tensors, as
for the other families).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from tilefuse import _checks, _dispatch, _launch, _scratch
from tilefuse._backend import choose_backend, forced_variant, gluon_hopper, interpreting, tl_status
from tilefuse._library import PlanCache, no_backward, plan_key, tilefuse_op, use_dispatcher
from tilefuse.ops.swiglu_fp8 import configs
from tilefuse.ops.swiglu_fp8.reference import FP8, GROUP, dequantize, swiglu_fp8_reference

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, FP8)


@functools.cache
def kernel_status(device: torch.device) -> dict[str, str]:
    """Which FP8 paths run on ``device`` ("ok" or why not): ``tl``, ``decode``, the Gluon ``ws``
    and the ``unfused`` pipeline (``torch._scaled_mm`` + the ``tl`` SiLU·mul pass)."""
    why = tl_status(device, 9, "TMA, FP8 tensor cores")
    return {"tl": why, "decode": why, "ws": "ok" if ws_usable(device) else
            "needs an sm_90 GPU (FP8 WGMMA) and Gluon; a pin runs the tl kernel instead",
            "unfused": why if why != "ok" or device.type == "cuda" else
            "the interpreter computes torch._scaled_mm's product in PyTorch"}


@functools.cache
def _kernel():
    from tilefuse.ops.swiglu_fp8 import kernels

    return _launch.Kernel(kernels.swiglu_fp8_kernel)


@functools.cache
def _decode_kernel():
    from tilefuse.ops.swiglu_fp8 import kernels

    return _launch.Kernel(kernels.swiglu_fp8_decode_kernel)


def _ws_kernel():
    """The Gluon kernel's launcher, or None where Triton has no Gluon Hopper module."""
    return _launch.optional_kernel("tilefuse.ops.swiglu_fp8.kernels_gluon", "swiglu_fp8_ws_kernel")


def ws_usable(device: torch.device) -> bool:
    """The Gluon kernel runs on ``device``: an sm_90 GPU and Gluon's Hopper module."""
    return gluon_hopper(device) and _ws_kernel() is not None


# ----------------------------------------------------------------------------- scales
def _scale_kind(name: str, scales, grouped: tuple[int, ...], per_row: tuple[tuple[int, ...], ...],
                expected: str) -> str:
    """Validate a scale tensor: "k" (shape ``grouped``: varies along K), "row" (one of ``per_row``:
    per token / per channel) or "tensor" (0-dim); ``expected`` spells the shapes for the error."""
    _checks.check_tensor(name, scales, dtypes=(torch.float32,))
    shape = tuple(scales.shape)
    if scales.dim() == 0:
        return "tensor"
    if any(_same_shape(shape, want) for want in per_row):
        return "row"
    if _same_shape(shape, grouped):
        return "k"
    raise ValueError(f"{name}: expected shape {expected}, got {shape}")


def _same_shape(shape: tuple, want: tuple) -> bool:
    """``shape == want`` size by size: under ``torch.compile(dynamic=True)`` the sizes are symbolic,
    and a tuple comparison (or ``in``) of symbolic sizes can come out False for equal shapes."""
    return len(shape) == len(want) and all(a == b for a, b in zip(shape, want))


def _as_2d(scales: torch.Tensor, rows: int) -> torch.Tensor:
    """Scales as the kernel reads them, 2-D with strides: a 0-dim (per-tensor) scale broadcast to
    [rows, 1] (stride 0), [rows] as [rows, 1], leading dimensions flattened."""
    if scales.dim() == 0:
        return scales.reshape(1, 1).expand(rows, 1)
    if scales.dim() == 1:
        return scales[:, None]
    return scales.reshape(-1, scales.shape[-1])


# ----------------------------------------------------------------------------- plan
class _Call:
    """What a call with one argument layout runs (validation included), worked out once."""

    __slots__ = ("reference", "m", "inter", "hidden", "out_shape", "scale_shape", "config", "x_grouped",
                 "w_blocked", "quant", "ws_config", "decode_config", "decode", "unfused", "choice")


_plans = PlanCache()


def _plan_call(x, x_scales, w_gate_up, w_scales, out_dtype) -> _Call:
    key = plan_key(x, x_scales, w_gate_up, w_scales)
    key = key + (out_dtype,) if key is not None and isinstance(out_dtype, torch.dtype) else None
    call = _plans.get(key) if key is not None else None
    if call is not None:
        return call
    x_kind, w_kind = _validate(x, x_scales, w_gate_up, w_scales, out_dtype)
    call = _Call()
    call.hidden, call.inter = x.shape[-1], w_gate_up.shape[0] // 2
    call.m = x.numel() // call.hidden if call.hidden else x.numel()
    call.out_shape = (*x.shape[:-1], call.inter)
    call.quant = out_dtype == FP8
    call.scale_shape = (*x.shape[:-1], call.inter // GROUP) if call.quant else (0,)
    call.x_grouped, call.w_blocked = x_kind == "k", w_kind == "k"
    call.reference = call.hidden == 0 or call.inter == 0 or choose_backend(x.device) != "triton"
    if not call.reference:
        if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] < 9:
            raise ValueError(f"x: swiglu_fp8 needs an sm_90+ GPU (TMA, FP8 tensor cores), got "
                             f"sm_{''.join(map(str, torch.cuda.get_device_capability(x.device)))}")
        chosen = configs.choose(call.m, call.hidden, call.inter, call.quant)
        forced = forced_variant("swiglu_fp8")
        call.config = (chosen if isinstance(chosen, configs.Fp8Config) else
                       configs.heuristic(call.m, call.hidden, call.inter, call.quant))
        call.ws_config = call.decode_config = call.decode = call.unfused = None
        form = configs.unfused_form(call.m, call.hidden, x_kind, w_kind) if x.device.type == "cuda" or interpreting() else None
        call.choice = _unfused_choice(call, chosen, form, x.device)
        if form is not None and (forced == "unfused" or (forced is None and call.choice[0])):
            call.unfused = form       # a pin where torch._scaled_mm cannot take the scales runs the default
        elif forced == "decode" or (forced is None and call.m <= configs.DECODE_MAX_M):
            call.decode_config = configs.decode_config(call.m, call.hidden, call.inter, call.quant)
            if call.m:
                # the whole launch but the pointers, worked out once: strides of the scales as the
                # kernel reads them (their layout is part of the plan key), a fresh contiguous output
                m = call.m
                call.decode = _decode_plan(x.device, m, call.inter, call.hidden, _as_2d(x_scales, m),
                                           _as_2d(w_scales, 2 * call.inter), call.inter,
                                           call.inter // GROUP if call.quant else None, call.decode_config,
                                           call.x_grouped, call.w_blocked, call.quant)
        elif (forced == "ws" or (forced is None and isinstance(chosen, configs.WsConfig))) and ws_usable(x.device):
            call.ws_config = chosen if isinstance(chosen, configs.WsConfig) else configs.ws_config(
                call.m, call.inter, call.quant)
            if call.quant and call.ws_config.block_n != 128:
                call.ws_config = dataclasses.replace(call.ws_config, block_n=128)   # one e4m3 group per tile row
    return _plans.remember(key, call)


def _unfused_choice(call: _Call, chosen, form: str | None, device) -> tuple:
    """(the unfused FP8 pipeline runs by default, its predicted time, the fused kernel's, the fused
    kernel's tiles: a ``WsConfig`` or an ``Fp8Config``) for the call's size
    (``configs.unfused_wins``); never at decode sizes (the split-K decode kernel streams the
    weight once, the pipeline streams it and then ``y``) nor where ``torch._scaled_mm`` does not
    take the scales (``form`` None)."""
    from tilefuse import _dispatch

    if call.m <= configs.DECODE_MAX_M:
        return False, None, None, None
    fused_cfg = chosen if isinstance(chosen, configs.WsConfig) and ws_usable(device) else (
        chosen if isinstance(chosen, configs.Fp8Config) else configs.heuristic(call.m, call.hidden, call.inter,
                                                                               call.quant))
    wins, unfused, fused = configs.unfused_wins(call.m, call.hidden, call.inter, call.quant,
                                                call.x_grouped or call.w_blocked, fused_cfg, _dispatch.chip(device))
    return wins and form is not None, (unfused if form is not None else None), fused, fused_cfg


def _validate(x, x_scales, w_gate_up, w_scales, out_dtype) -> tuple[str, str]:
    _checks.check_tensor("x", x, dtypes=(FP8,), min_ndim=1)
    _checks.check_tensor("w_gate_up", w_gate_up, dtypes=(FP8,), ndim=2)
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype: expected one of {tuple(str(d).replace('torch.', '') for d in OUT_DTYPES)}, "
                         f"got {out_dtype!r}")
    hidden, rows = x.shape[-1], w_gate_up.shape[0]
    _checks.check_shape("w_gate_up", w_gate_up, (None, hidden), f"[2I, K={hidden}]")
    _checks.check_multiple("w_gate_up", rows, 2, "2I (rows)")
    lead, kg, ng = tuple(x.shape[:-1]), -(-hidden // GROUP), -(-rows // GROUP)
    x_kind = _scale_kind("x_scales", x_scales, (*lead, kg), ((*lead, 1),),
                         f"[..., K/128={kg}] (1 x 128 groups), [..., 1] (per token) or [] (per tensor), "
                         f"with x's leading dimensions {list(lead)}")
    w_kind = _scale_kind("w_scales", w_scales, (ng, kg), ((rows, 1), (rows,)),
                         f"[2I/128={ng}, K/128={kg}] (128 x 128 blocks), [2I={rows}, 1] or [2I] (per channel) "
                         f"or [] (per tensor)")
    if "k" in (x_kind, w_kind):
        what = "x_scales has 1 x 128 groups" if x_kind == "k" else "w_scales has 128 x 128 blocks"
        _checks.check_multiple("x", hidden, GROUP, f"K (last dimension; {what})")
    else:
        _checks.check_multiple("x", hidden, 16, "K (last dimension; 16-byte rows for TMA)")
    if w_kind == "k":
        _checks.check_multiple("w_gate_up", rows // 2, GROUP, "I (2I rows; w_scales has 128 x 128 blocks)")
    if out_dtype == FP8:
        _checks.check_multiple("w_gate_up", rows // 2, GROUP, "I (2I rows; out_dtype e4m3 has 1 x 128 groups)")
    else:
        _checks.check_multiple("w_gate_up", rows // 2, 16, "I (2I rows; 16-byte output rows for TMA)")
    _checks.check_contiguous("x", x)
    _checks.check_contiguous("w_gate_up", w_gate_up)
    _checks.check_same_device(x=x, x_scales=x_scales, w_gate_up=w_gate_up, w_scales=w_scales)
    return x_kind, w_kind


# ----------------------------------------------------------------------------- launch
def run_kernel(x2d, xs, w, ws, out, out_scales, cfg: configs.Fp8Config, x_grouped: bool, w_blocked: bool,
               quant: bool) -> None:
    """Launch on a 2-D problem: ``x2d [M, K]`` e4m3, ``xs`` [M, K/128] or [M, 1], ``w [2I, K]``,
    ``ws`` [2I/128, K/128] or [2I, 1]; ``out [M, I]`` (e4m3 when ``quant``, or an fp32 buffer that
    receives the unrounded quotients: the interpreter's e4m3 conversion is wrong), ``out_scales
    [M, I/128]`` fp32 when ``quant``. All 16-byte aligned, unit last stride."""
    m, k = x2d.shape
    inter = w.shape[0] // 2
    x_desc = _launch.descriptor(x2d, [m, k], [x2d.stride(0), 1], [cfg.block_m, cfg.block_k])
    w_desc = _launch.descriptor(w, [2, inter, k], [inter * k, k, 1], [2, cfg.block_n, cfg.block_k])
    out_desc = _launch.descriptor(out, [m, inter], [out.stride(0), 1], [cfg.block_m, cfg.block_n])
    tiles = -(-m // cfg.block_m) * -(-inter // cfg.block_n)
    os_ = out_scales if quant else xs
    key = (x2d.device, out.dtype, m, inter, k, xs.stride(), ws.stride(), os_.stride(0), cfg, x_grouped, w_blocked,
           quant, configs.PROMOTE, _launch.aligned(xs, ws, os_))
    _kernel()(key, (tiles,), x2d.device.index,
              x_desc, w_desc, out_desc, xs, ws, os_,
              m, inter, k, xs.stride(0), xs.stride(1), ws.stride(0), ws.stride(1), os_.stride(0),
              X_GROUPED=x_grouped, W_BLOCKED=w_blocked, QUANT_OUT=quant,
              BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
              PROMOTE=configs.PROMOTE, num_stages=cfg.num_stages, num_warps=cfg.num_warps)


def launch_ws(x2d, xs, w, ws, out, out_scales, cfg: configs.WsConfig, x_grouped: bool, w_blocked: bool,
              quant: bool) -> None:
    """The Gluon kernel on a 2-D problem, arguments as :func:`run_kernel` (an e4m3 ``out`` when
    ``quant``); a persistent grid of one program per SM (fewer when the tiles are fewer)."""
    from tilefuse._backend import num_sms

    m, k = x2d.shape
    inter = w.shape[0] // 2

    def desc(t, rows, cols, stride, block):
        return _launch.descriptor(t, [rows, cols], [stride, 1], block, gluon=True)

    x_desc = desc(x2d, m, k, x2d.stride(0), [128, 128])
    w_desc = desc(w, 2 * inter, k, k, [64, 128])
    out_desc = desc(out, m, inter, out.stride(0), [64, 64])
    tiles = -(-m // 128) * -(-inter // cfg.block_n)
    grid = (min(num_sms(x2d.device), tiles), 1, 1)
    os_ = out_scales if quant else xs
    key = (x2d.device, out.dtype, m, inter, k, xs.stride(), ws.stride(), os_.stride(0), cfg, grid, x_grouped,
           w_blocked, quant, _launch.aligned(xs, ws, os_))
    _ws_kernel().launch(
        key, grid, x2d.device.index, (x_desc, w_desc, out_desc, xs, ws, os_),
        (m, inter, k, xs.stride(0), xs.stride(1), ws.stride(0), ws.stride(1), os_.stride(0)),
        dict(X_GROUPED=x_grouped, W_BLOCKED=w_blocked, QUANT_OUT=quant, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m,
             STAGES=cfg.stages, NUM_SMS=grid[0], num_warps=4))


def scaled_gemm(x2d, x_scales, w, w_scales, form: str) -> torch.Tensor:
    """``y [M, 2I] = Xd Wd^T`` in bf16 by cuBLASLt's FP8 GEMM (``torch._scaled_mm``), the first
    half of the unfused pipeline. ``x2d [M, K]``, ``w [2I, K]`` e4m3 contiguous; the scales as
    :func:`swiglu_fp8` takes them, in the ``form`` of ``configs.unfused_form``: "block" (1 x 128
    groups, 128 x 128 blocks), "row" (per token / per channel; a 0-dim side broadcast to its
    rows) or "tensor". Off CUDA (the interpreter) the same product from the dequantized operands
    in fp32, rounded to bf16 as cuBLASLt's output is."""
    m, rows = x2d.shape[0], w.shape[0]
    if not x2d.is_cuda:
        xd = dequantize(x2d, x_scales.reshape(m, -1) if x_scales.dim() else x_scales, dtype=torch.float32)
        return (xd @ dequantize(w, w_scales, weight=True, dtype=torch.float32).T).to(torch.bfloat16)
    if form == "block":   # cuBLASLt's layouts: the activations' scales M-major, the weights' as [K/128, 2I/128]
        scale_a, scale_b = x_scales.reshape(m, -1).t().contiguous().t(), w_scales.t()
    elif form == "row":
        scale_a = x_scales.reshape(m, 1) if x_scales.dim() else x_scales.reshape(1, 1).expand(m, 1).contiguous()
        scale_b = w_scales.reshape(1, rows) if w_scales.dim() else w_scales.reshape(1, 1).expand(1, rows).contiguous()
    else:
        scale_a, scale_b = x_scales, w_scales
    # cuBLASLt's workspace: one per captured graph while a CUDA graph captures (_scratch.blas)
    return _scratch.blas(torch._scaled_mm, x2d, w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)


def run_unfused(x2d, x_scales, w, w_scales, out, out_scales, form: str) -> None:
    """The unfused FP8 pipeline the dispatch keeps as a candidate (variant ``"unfused"``):
    :func:`scaled_gemm`, then one SiLU·mul pass over ``y`` (fp32, one rounding to ``out``'s dtype,
    or the 1 x 128 re-quantization into ``out`` / ``out_scales [M, I/128]`` when given). ``y`` is
    rounded to bf16 once more than in the fused kernels, as in the pipeline this path stands for."""
    from tilefuse.ops.swiglu.op import silu_mul

    silu_mul(scaled_gemm(x2d, x_scales, w, w_scales, form), out, out_scales=out_scales)


@dataclasses.dataclass(frozen=True)
class _DecodePlan:
    """A decode-kernel launch without its pointers: grid, compiled-kernel key, run-time scalars,
    constexprs, and the split-K workspace (fp32 elements) and ticket count (0 without a split)."""
    grid: tuple
    key: tuple
    scalars: tuple
    meta: dict
    workspace: int
    locks: int


def _decode_plan(device, m, inter, k, xs, ws, out_stride, os_stride, cfg: configs.DecodeConfig, x_grouped: bool,
                 w_blocked: bool, quant: bool) -> _DecodePlan:
    """``xs`` / ``ws``: the scales in their 2-D kernel view (:func:`_as_2d`); ``os_stride``: the
    row stride of the e4m3 output's scales (None without them: the kernel then reads x's)."""
    grid = (-(-inter // cfg.block_n), -(-m // cfg.block_m), cfg.split_k)
    os_stride = xs.stride(0) if os_stride is None else os_stride
    strides = (k, k, out_stride, xs.stride(0), xs.stride(1), ws.stride(0), ws.stride(1), os_stride)
    split = cfg.split_k > 1
    return _DecodePlan(
        grid, (device, m, inter, k, strides, cfg, x_grouped, w_blocked, quant), (m, inter, k, *strides, 0.0),
        dict(X_GROUPED=x_grouped, W_BLOCKED=w_blocked, QUANT_OUT=quant, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
             SPLIT_K=cfg.split_k, EVEN_K=k % 128 == 0, num_stages=cfg.num_stages, num_warps=cfg.num_warps),
        cfg.split_k * 2 * m * inter if split else 0, grid[0] * grid[1] if split else 0)


def _launch_decode_plan(plan: _DecodePlan, device, x, w, xs, ws, out, os_) -> None:
    """The hot path: x [M, K] and w [2I, K] contiguous e4m3 (16-byte aligned), the scales as given
    (any view of the plan's layout), out / os_ fresh. The compiled kernel is specialized on the
    scales' 16-byte alignment and on the output's dtype, so both are part of the key."""
    if plan.locks:    # fp32 partials [SPLIT_K, 2, M, I] (written before read), one zeroed ticket per tile
        (part,) = _scratch.workspace(device, (plan.workspace, torch.float32))
        (locks,) = _scratch.zeroed(device, (plan.locks, torch.int32))
    else:
        part = locks = out    # unused
    key = (plan.key, out.dtype, _launch.aligned(xs, ws, os_))
    _decode_kernel().launch(key, plan.grid, device.index, (x, w, xs, ws, out, os_, part, locks), plan.scalars,
                            plan.meta)


def launch_decode(x2d, xs, w, ws, out, out_scales, cfg: configs.DecodeConfig, x_grouped: bool, w_blocked: bool,
                  quant: bool) -> None:
    """The split-K decode kernel on a 2-D problem, arguments as :func:`run_kernel` (pointer loads;
    x2d and w contiguous and 16-byte aligned)."""
    m, k = x2d.shape
    inter = w.shape[0] // 2
    plan = _decode_plan(x2d.device, m, inter, k, xs, ws, out.stride(0), out_scales.stride(0) if quant else None,
                        cfg, x_grouped, w_blocked, quant)
    _launch_decode_plan(plan, x2d.device, x2d, w, xs, ws, out, out_scales if quant else xs)


def _run(call: _Call, x, x_scales, w_gate_up, w_scales, out_dtype):
    if call.reference:   # cuBLAS GEMMs on a GPU: a workspace per captured graph (_scratch.blas)
        out = _scratch.blas(swiglu_fp8_reference, x, x_scales, w_gate_up, w_scales, out_dtype=out_dtype,
                            compute_dtype=torch.float32)
        return out if call.quant else (out, x.new_empty(call.scale_shape, dtype=torch.float32))
    carrier = call.quant and interpreting()
    out = torch.empty(call.out_shape, dtype=torch.float32 if carrier else out_dtype, device=x.device)
    scales = torch.empty(call.scale_shape, dtype=torch.float32, device=x.device)
    if call.m:
        m, hidden, inter = call.m, call.hidden, call.inter
        if x.data_ptr() % 16:             # TMA needs 16-byte aligned bases (rows already are: K % 16 == 0)
            x = x.clone()
        if w_gate_up.data_ptr() % 16:
            w_gate_up = w_gate_up.clone()
        if call.unfused is not None:      # cuBLASLt's FP8 GEMM, then the SiLU·mul pass
            run_unfused(x.view(m, hidden), x_scales, w_gate_up, w_scales, out.view(m, inter),
                        scales.view(m, -1) if call.quant else None, call.unfused)
        elif call.decode is not None:     # decode sizes: no views, the launch worked out in the plan
            _launch_decode_plan(call.decode, x.device, x, w_gate_up, x_scales, w_scales, out,
                                scales if call.quant else x_scales)
        else:
            launch = launch_ws if call.ws_config is not None else run_kernel
            launch(x.view(m, hidden), _as_2d(x_scales, m), w_gate_up, _as_2d(w_scales, 2 * inter),
                   out.view(m, inter), scales.view(m, -1) if call.quant else scales, call.ws_config or call.config,
                   call.x_grouped, call.w_blocked, call.quant)
    return (out.to(FP8) if carrier else out), scales


def _fake(x, x_scales, w_gate_up, w_scales, out_dtype):
    inter = w_gate_up.shape[0] // 2
    quant = out_dtype == FP8
    return (x.new_empty(*x.shape[:-1], inter, dtype=out_dtype),
            x.new_empty(*(x.shape[:-1] + (inter // GROUP,) if quant else (0,)), dtype=torch.float32))


@tilefuse_op("swiglu_fp8", fake=_fake, backward=no_backward("swiglu_fp8", "the FP8 inference op"),
             setup_context=lambda ctx, inputs, output: None)
def _swiglu_fp8_op(x: torch.Tensor, x_scales: torch.Tensor, w_gate_up: torch.Tensor, w_scales: torch.Tensor,
                   out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _run(_plan_call(x, x_scales, w_gate_up, w_scales, out_dtype), x, x_scales, w_gate_up, w_scales,
                out_dtype)


def swiglu_fp8(x: torch.Tensor, x_scales: torch.Tensor, w_gate_up: torch.Tensor, w_scales: torch.Tensor, *,
               out_dtype: torch.dtype = torch.bfloat16):
    """Fused FP8 ``silu(Xd Wgd^T) * (Xd Wud^T)`` from scaled e4m3 operands (``Xd = x * x_scales``,
    ``Wd = w_gate_up * w_scales``); fp32 accumulation, scales applied per 128-wide K block.

    Parameters
    ----------
    x : [..., K] float8_e4m3fn, contiguous. K a multiple of 128 when either side has group/block
        scales, else of 16.
    x_scales : fp32; [..., K/128] (1 x 128 groups per token, DeepSeek-V3 / transformers' dynamic
        FP8 activations), [..., 1] (per token) or [] (per tensor).
    w_gate_up : [2I, K] float8_e4m3fn, contiguous, merged (gate rows, then up rows).
    w_scales : fp32; [2I/128, K/128] (128 x 128 blocks: transformers' ``weight_scale_inv``
        stacked for gate and up; I a multiple of 128), [2I, 1] or [2I] (per output channel,
        ``torch._scaled_mm`` row-wise) or [] (per tensor).
    out_dtype : bfloat16 (default), float16 or float32: ``h`` rounded once. float8_e4m3fn: ``h``
        re-quantized in the epilogue with one fp32 scale per token and 1 x 128 group of the I
        output columns (``amax / 448``; 1 for an all-zero group; I a multiple of 128), ready for a
        block-scaled down projection.

    Returns
    -------
    [..., I] in ``out_dtype``; for float8_e4m3fn the pair (``h`` [..., I] e4m3, scales
    [..., I/128] fp32) with ``h ~= out * scales`` per group. Inference only (no backward).

    Examples
    --------
    >>> from tilefuse.ops.swiglu_fp8.reference import quantize_fp8
    >>> w, w_s = quantize_fp8(torch.cat([w_gate, w_up]), block=True)     # [2I, K], [2I/128, K/128]
    >>> x8, x_s = quantize_fp8(x)                                        # [M, K], [M, K/128]
    >>> h = tilefuse.swiglu_fp8(x8, x_s, w, w_s)                         # [M, I] bf16
    >>> h8, h_s = tilefuse.swiglu_fp8(x8, x_s, w, w_s, out_dtype=torch.float8_e4m3fn)
    """
    if torch.compiler.is_compiling():
        # traced: argument checks only (metadata); the op plans when it runs, outside tracing
        _validate(x, x_scales, w_gate_up, w_scales, out_dtype)
        out, scales = _swiglu_fp8_op(x, x_scales, w_gate_up, w_scales, out_dtype)
        return (out, scales) if out_dtype == FP8 else out
    call = _plan_call(x, x_scales, w_gate_up, w_scales, out_dtype)
    if use_dispatcher(x, x_scales, w_gate_up, w_scales):
        out, scales = _swiglu_fp8_op(x, x_scales, w_gate_up, w_scales, out_dtype)
    else:
        out, scales = _run(call, x, x_scales, w_gate_up, w_scales, out_dtype)
    return (out, scales) if call.quant else out


def explain(x: torch.Tensor, x_scales: torch.Tensor, w_gate_up: torch.Tensor, w_scales: torch.Tensor, *,
            out_dtype: torch.dtype = torch.bfloat16, **_) -> _dispatch.Choice:
    """The kernel ``swiglu_fp8(x, x_scales, w_gate_up, w_scales, out_dtype=...)`` runs and why
    (``tilefuse.explain``): the split-K decode kernel up to ``configs.DECODE_MAX_M`` rows; above,
    the fused kernel of ``configs.TUNED``'s M bucket (the Gluon warp-specialized kernel where it
    runs and fills enough SMs, else the ``tl`` kernel) weighed by the cost model against the
    unfused FP8 pipeline (``torch._scaled_mm`` + the SiLU·mul pass, ``configs.unfused_wins``),
    both with their predicted times."""
    call = _plan_call(x, x_scales, w_gate_up, w_scales, out_dtype)
    problem = {"M": call.m, "H": call.hidden, "I": call.inter, "out": str(out_dtype).removeprefix("torch."),
               "device": str(x.device)}
    if call.reference:
        return _dispatch.Choice("swiglu_fp8", problem, "reference", None, "reference")
    forced = forced_variant("swiglu_fp8")
    _, unfused_us, fused_us, fused_cfg = call.choice
    if call.unfused is not None:
        variant, config = "unfused", call.unfused
    elif call.decode_config is not None:
        variant, config = "decode", call.decode_config
    elif call.ws_config is not None:
        variant, config = "ws", call.ws_config
    else:
        variant, config = "tl", call.config
    if forced:
        source = "forced" + ("" if forced == variant else
                             f"; {forced} cannot run here (ws: a Hopper GPU; unfused: scales torch._scaled_mm takes)")
    elif call.m <= configs.DECODE_MAX_M:
        source = f"measured rule (the decode kernel up to {configs.DECODE_MAX_M} rows)"
    else:
        source = "cost model (configs.TUNED's fused kernel against the unfused pipeline)"
    fused = (variant, config) if variant != "unfused" else (
        ("ws" if isinstance(fused_cfg, configs.WsConfig) else "tl"), fused_cfg)
    candidates = (_dispatch.Candidate(*fused, fused_us),
                  _dispatch.Candidate("unfused", call.unfused, unfused_us,
                                      "torch._scaled_mm on [2I, K], bf16 out, + one SiLU*mul pass"
                                      if unfused_us is not None or call.m <= configs.DECODE_MAX_M else
                                      "torch._scaled_mm does not take these scales at this M and K"))
    return _dispatch.Choice("swiglu_fp8", problem, variant, config, source, candidates)
