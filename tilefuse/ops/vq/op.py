"""``tilefuse.vq_matmul``: validation, launchers, config choice, dispatch, custom-op registration.

Kernels: ``kernels.py`` (``tl``: decode reference schedule + prefill) and ``kernels_gluon.py`` (the
fast decode kernel). Spec: ``reference.py``.

Variants (``tilefuse.force(variant=...)``):

* ``"decode"``    -- one-launch table + lookup kernel (Gluon on a GPU, ``tl`` under the interpreter)
* ``"decode_tl"`` -- the same schedule written in ``tl`` (CPU-tested; slow on a GPU, see kernels.py)
* ``"prefill"``   -- fused: dequantize tiles in registers + tensor-core GEMM in one kernel
* ``"dequant"``   -- dequantize the layer into a scratch weight (one kernel), then cuBLAS

Default dispatch: ``decode`` for at most ``DECODE_SWITCH_TOKENS`` tokens, ``dequant`` above. Decode
is the shared-memory-resident table kernel (``kernels_resident.py``) for 1-4 tokens with K a
multiple of 16, else the ``gl.gather`` kernel (``kernels_gluon.py``). Measured on the H200
(bench/results/vq-h200.json, ``decode_over_dequant_time``): the resident kernel at 4 tokens takes
0.39-0.67x the dequant path's time on the six bench shapes, so decode is chosen up to 4 tokens;
5-8 tokens would need two resident launches, which lose to dequant on the small shapes. The fused
``prefill`` kernel measured 14-33x slower than cuBLAS, so it is never chosen by default.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch
import triton

from tilefuse import _checks
from tilefuse._backend import choose_backend, forced_variant, interpreting, num_sms
from tilefuse._library import tilefuse_op
from tilefuse.ops.vq.reference import vq_matmul_reference

VARIANTS = ("decode", "decode_tl", "prefill", "dequant")
DECODE_MAX_TOKENS = 8            # the decode kernel packs up to 8 tokens into its table columns
DECODE_SWITCH_TOKENS = 4         # measured: the resident decode beats dequantize + cuBLAS up to 4 tokens
CODE_DTYPES = (torch.uint8, torch.int8)
WIDE_CODE_DTYPES = (torch.int16, torch.int32, torch.int64)

_workspaces: dict = {}


@functools.cache
def _gluon_kernel(module: str, name: str):
    """A Gluon kernel of ``tilefuse.ops.vq.<module>``, or None when Gluon is not importable here
    (looked up once: launchers call this on every launch)."""
    try:
        return getattr(importlib.import_module(f"tilefuse.ops.vq.{module}"), name)
    except Exception:  # pragma: no cover - depends on the Triton build
        return None


def _gluon_decode():
    """The gl.gather Gluon decode kernel (``kernels_gluon.py``), or None."""
    return _gluon_kernel("kernels_gluon", "vq_decode_gluon_kernel")


def kernel_status(device: torch.device) -> dict[str, str]:
    """Which VQ kernel variants run on ``device`` ("ok" or why not)."""
    if device.type != "cuda":
        why = "ok (interpreter)" if interpreting() else "needs CUDA or TRITON_INTERPRET=1"
        return {"decode": why + "; tl schedule", "decode_tl": why, "prefill": why, "dequant": why}
    major, _ = torch.cuda.get_device_capability(device)
    mma_ok = "ok" if major >= 8 else f"needs sm_80+ (got sm_{major}x)"
    return {
        "decode": mma_ok if _gluon_decode() is not None else "Gluon not importable: falls back to decode_tl",
        "decode_tl": "ok (correct but slow on GPU: Triton lowers tl.gather to warp shuffles)",
        "prefill": mma_ok + " (fused; slow: see bench/results/vq-h200.json)",
        "dequant": "ok",
    }


def _workspace(device: torch.device, n: int):
    """Zeroed fp32 split-K workspace [8, N] + arrival counters; the kernels leave them zeroed."""
    key = (device, n)
    if key not in _workspaces:
        _workspaces[key] = (torch.zeros(DECODE_MAX_TOKENS, n, dtype=torch.float32, device=device),
                            torch.zeros(triton.cdiv(n, 16), dtype=torch.int32, device=device))
    return _workspaces[key]


# H200 decode schedule; ``TILEFUSE_VQ_DECODE_CFG="block_n=128,num_warps=8,convert_table=1,split_mult=2"``
# overrides it (the GPU script's sweep uses this to benchmark the config it picked).
DECODE_TUNED = dict(block_n=256, num_warps=8, convert_table=1, split_mult=2)


def _tuned_env(var: str, tuned: dict) -> dict:
    """``tuned`` with ``key=value`` overrides from the environment variable ``var``."""
    cfg = dict(tuned)
    for item in filter(None, os.environ.get(var, "").split(",")):
        key, _, value = item.partition("=")
        if key.strip() not in cfg:
            raise ValueError(f"{var}: unknown key {key!r}, expected one of {tuple(cfg)}")
        cfg[key.strip()] = int(value)
    return cfg


def decode_config(m: int, n: int, k: int, device: torch.device) -> dict:
    """BLOCK_N / warps / table columns / split-K for the decode kernel."""
    m_pad = triton.next_power_of_2(max(m, 1))
    cols = 32
    tuned = _tuned_env("TILEFUSE_VQ_DECODE_CFG", DECODE_TUNED)
    if device.type != "cuda":
        block_n, num_warps = min(64, max(16, triton.next_power_of_2(n))), 4
    else:
        block_n, num_warps = tuned["block_n"], tuned["num_warps"]
    groups = k // 8
    gm = cols // m_pad
    steps = triton.cdiv(groups, gm)
    row_blocks = triton.cdiv(n, block_n)
    # split K so that about split_mult programs per SM run (one CTA fits an SM: ~255 registers)
    split = max(1, min(steps, round(tuned["split_mult"] * num_sms(device) / row_blocks)))
    return dict(block_n=block_n, num_warps=num_warps, cols=cols, m_pad=m_pad, split_k=split,
                convert_table=bool(tuned["convert_table"]))


def _resident_decode():
    """The table-resident Gluon decode kernel (``kernels_resident.py``), or None."""
    return _gluon_kernel("kernels_resident", "vq_decode_resident_kernel")


# H200 resident-table schedule, the sweep's pick (bench/results/vq-h200-sweep.json) that the full
# bench ran; ``TILEFUSE_VQ_RESIDENT_CFG="block_r=256,num_warps=16"`` overrides it.
RESIDENT_TUNED = dict(block_r=128, num_warps=16, build_rows=256)
RESIDENT_MAX_TOKENS = 4          # table columns = 64 = groups per slice x tokens


def resident_config(m: int, n: int, k: int, device: torch.device) -> dict:
    """Grid of the resident kernel: K slices of ``64 / M_PAD`` groups x row chunks.

    One CTA per SM (the 128 KB table), so the row-chunk count ``c`` minimizes
    ``waves(c) * (rows per program + build_rows)``; ``build_rows`` is the table build's cost in
    rows' worth of lookups (measured on the H200, see docs/vq.md)."""
    cfg = _tuned_env("TILEFUSE_VQ_RESIDENT_CFG", RESIDENT_TUNED)
    m_pad = triton.next_power_of_2(max(m, 1))
    k_slices = triton.cdiv(k // 8, 64 // m_pad)
    sms = num_sms(device)
    max_chunks = triton.cdiv(n, 32)
    cost = lambda c: triton.cdiv(k_slices * c, sms) * (triton.cdiv(n, c) + cfg["build_rows"])  # noqa: E731
    chunks = min(range(1, max_chunks + 1), key=lambda c: (cost(c), c))
    rows_per_prog = triton.cdiv(triton.cdiv(n, chunks), 32) * 32
    return dict(m_pad=m_pad, block_r=cfg["block_r"], num_warps=cfg["num_warps"], k_slices=k_slices,
                chunks=triton.cdiv(n, rows_per_prog), rows_per_prog=rows_per_prog)


def _launch_resident(x2d, codes, codebooks, scales, bias, out):
    m, k = x2d.shape
    n = codes.shape[0]
    cfg = resident_config(m, n, k, x2d.device)
    ws, cnt = _workspace(x2d.device, n)
    words = code_words(codes)
    grid = (cfg["chunks"], cfg["k_slices"])
    _resident_decode()[grid](
        x2d, words, codebooks, scales, bias if bias is not None else scales, out, ws, cnt,
        m, n, k // 8, cfg["rows_per_prog"], cfg["k_slices"], x2d.stride(0), words.stride(0), out.stride(0),
        M_PAD=cfg["m_pad"], BLOCK_R=cfg["block_r"], SPLIT=cfg["k_slices"] > 1, HAS_BIAS=bias is not None,
        NUM_WARPS=cfg["num_warps"], num_warps=cfg["num_warps"])
    return out


def code_words(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K/8, 2] uint8/int8 (contiguous, K/8 even) -> int32 words [N, K/16]; word w of a
    row holds bytes c0(2w), c1(2w), c0(2w+1), c1(2w+1), low byte first (little endian)."""
    n = codes.shape[0]
    return codes.reshape(n, -1).view(torch.int32)


def resident_applies(m: int, k: int, device: torch.device) -> bool:
    """The resident kernel takes 1-4 tokens and an even number of groups (int32 code words)."""
    return (device.type == "cuda" and m <= RESIDENT_MAX_TOKENS and (k // 8) % 2 == 0
            and _resident_decode() is not None)


def launch_decode(x2d, codes, codebooks, scales, bias, out, *, impl: str = "auto", block_n=None,
                  num_warps=None, split_k=None, convert_table: bool | None = None) -> torch.Tensor:
    """Run a one-launch decode kernel: ``out[:M] = x2d @ W^T (+ bias)`` for M <= 8 tokens.

    x2d: [M, K]; codes: [N, K/8, 2] uint8/int8 contiguous; out: [M, N] (any contents).
    impl: "auto" (resident table where it applies, else gather), "resident", "gather" (Gluon,
    ``gl.gather`` per K step) or "tl" (the CPU-tested schedule). The keyword overrides configure
    the gather/tl kernels.
    """
    m, k = x2d.shape
    n = codes.shape[0]
    if m > DECODE_MAX_TOKENS:
        raise ValueError(f"x: the decode kernel takes at most {DECODE_MAX_TOKENS} tokens, got {m}")
    if impl in ("auto", "resident") and resident_applies(m, k, x2d.device):
        return _launch_resident(x2d, codes, codebooks, scales, bias, out)
    if impl == "resident":
        raise ValueError(f"x: the resident decode kernel needs CUDA, at most {RESIDENT_MAX_TOKENS} tokens "
                         f"and K a multiple of 16, got {m} tokens, K={k} on {x2d.device}")
    cfg = decode_config(m, n, k, x2d.device)
    block_n = block_n or cfg["block_n"]
    convert_table = cfg["convert_table"] if convert_table is None else convert_table
    num_warps = num_warps or cfg["num_warps"]
    groups = k // 8
    gm = cfg["cols"] // cfg["m_pad"]
    steps = triton.cdiv(groups, gm)
    split = max(1, min(split_k or cfg["split_k"], steps))
    groups_per_split = triton.cdiv(steps, split) * gm
    split = triton.cdiv(groups, groups_per_split)
    ws, cnt = _workspace(x2d.device, n)
    codes16 = codes.view(torch.int16).view(n, groups)
    grid = (triton.cdiv(n, block_n), split)
    args = (x2d, codes16, codebooks, scales, bias if bias is not None else scales, out, ws, cnt,
            m, n, groups, groups_per_split, split, x2d.stride(0), codes16.stride(0), out.stride(0))
    meta = dict(BLOCK_N=block_n, COLS=cfg["cols"], M_PAD=cfg["m_pad"], SPLIT=split > 1, HAS_BIAS=bias is not None)
    kernel = _gluon_decode() if impl != "tl" and x2d.device.type == "cuda" else None
    if kernel is not None:
        kernel[grid](*args, **meta, NUM_WARPS=num_warps, CONVERT_TABLE=convert_table, num_warps=num_warps)
    else:
        from tilefuse.ops.vq.kernels import vq_decode_kernel

        vq_decode_kernel[grid](*args, **meta, num_warps=num_warps)
    return out


def prefill_config(m: int, n: int, k: int, device: torch.device) -> dict:
    if device.type != "cuda":
        return dict(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1, group_m=4)
    block_m = min(128, max(16, triton.next_power_of_2(m)))
    return dict(block_m=block_m, block_n=128, block_k=64, num_warps=8 if block_m >= 64 else 4,
                num_stages=3, group_m=8)


def launch_prefill(x2d, codes, codebooks, scales, bias, out, **override) -> torch.Tensor:
    """Dequantize-in-registers GEMM: ``out = x2d @ W^T (+ bias)``; x2d [M, K], out [M, N]."""
    m, k = x2d.shape
    n = codes.shape[0]
    cfg = {**prefill_config(m, n, k, x2d.device), **{key: v for key, v in override.items() if v}}
    codes8 = codes.view(torch.uint8)
    grid = (triton.cdiv(m, cfg["block_m"]) * triton.cdiv(n, cfg["block_n"]),)
    from tilefuse.ops.vq.kernels import vq_prefill_kernel

    vq_prefill_kernel[grid](
        x2d, codes8, codebooks, scales, bias if bias is not None else scales, out,
        m, n, k, x2d.stride(0), codes8.stride(0), out.stride(0),
        BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], GROUP_M=cfg["group_m"],
        HAS_BIAS=bias is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def launch_dequant(x2d, codes, codebooks, scales, bias, out, *, block_n: int = 16, block_g: int = 64,
                   num_warps: int = 4) -> torch.Tensor:
    """Dequantize W (one Triton kernel) into a scratch ``[N, K]`` in x's dtype, then cuBLAS."""
    m, k = x2d.shape
    n = codes.shape[0]
    codes8 = codes.view(torch.uint8)
    w = torch.empty(n, k, dtype=x2d.dtype, device=x2d.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(k // 8, block_g))
    from tilefuse.ops.vq.kernels import vq_dequant_kernel

    vq_dequant_kernel[grid](codes8, codebooks, scales, w, n, k // 8, codes8.stride(0), w.stride(0),
                            BLOCK_N=block_n, BLOCK_G=block_g, num_warps=num_warps)
    if bias is None:
        torch.mm(x2d, w.t(), out=out)
    else:
        torch.addmm(bias.to(x2d.dtype), x2d, w.t(), out=out)
    return out


def choose_variant(m: int) -> str:
    variant = forced_variant()
    if variant is not None:
        _checks.check_choice("variant", variant, VARIANTS)
        return variant
    return "decode" if m <= DECODE_SWITCH_TOKENS else "dequant"


def _vq_matmul_fake(x, codes, codebooks, scales, bias):
    return x.new_empty(*x.shape[:-1], codes.shape[0])


@tilefuse_op("vq_matmul", fake=_vq_matmul_fake)
def _vq_matmul(x: torch.Tensor, codes: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    if choose_backend(x.device) != "triton":
        return vq_matmul_reference(x, codes, codebooks, scales, bias)
    n = codes.shape[0]
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    m = x2d.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    scales_1d = scales.reshape(n)
    variant = choose_variant(m)
    if variant == "prefill":
        launch_prefill(x2d, codes, codebooks, scales_1d, bias, out)
    elif variant == "dequant":
        launch_dequant(x2d, codes, codebooks, scales_1d, bias, out)
    else:
        impl = "auto" if variant == "decode" else "tl"
        for start in range(0, m, DECODE_MAX_TOKENS):  # forced decode on more tokens: 8 at a time
            stop = min(m, start + DECODE_MAX_TOKENS)
            launch_decode(x2d[start:stop], codes, codebooks, scales_1d, bias, out[start:stop], impl=impl)
    return out.reshape(*x.shape[:-1], n)


def _debug() -> bool:
    return os.environ.get("TILEFUSE_DEBUG", "0") not in ("", "0")


def vq_matmul(x: torch.Tensor, codes: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor,
              bias: torch.Tensor | None = None, *, check_codes: bool = False) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for a 2-bit weight in AQLM's 2x8 format, never materializing ``W``.

    ``W[n, 8g:8g+8] = scales[n] * (C0[codes[n, g, 0]] + C1[codes[n, g, 1]])``.

    Parameters
    ----------
    x : [..., K] fp16 or bf16, K a multiple of 8.
    codes : [N, K/8, 2] uint8, or int8 as AQLM stores them (two's complement: -1 is code 255).
        A wider integer dtype (int16/32/64) is narrowed to uint8; its values must lie in
        [0, 256), which is checked only with ``check_codes=True`` or ``TILEFUSE_DEBUG=1``.
    codebooks : [2, 256, 1, 8] fp16 or bf16 (rounded to x's dtype inside the kernels).
    scales : [N, 1, 1, 1] (or [N]) floating point, per output row.
    bias : [N] floating point or None.

    Returns
    -------
    [..., N] in x's dtype. Accumulation is fp32. 1-4 tokens run the one-launch table-lookup
    decode kernel; more tokens dequantize the weight into a scratch [N, K] (one kernel) and run
    cuBLAS (the measured switch point, see ``DECODE_SWITCH_TOKENS``).
    """
    _checks.check_tensor("x", x, dtypes=_checks.FLOAT16S, min_ndim=1)
    _checks.check_tensor("codes", codes, dtypes=CODE_DTYPES + WIDE_CODE_DTYPES, ndim=3)
    _checks.check_tensor("codebooks", codebooks, dtypes=_checks.FLOAT16S, ndim=4)
    _checks.check_tensor("scales", scales, min_ndim=1)
    k = x.shape[-1]
    _checks.check_multiple("x", k, 8, "K (last dimension)")
    n = codes.shape[0]
    _checks.check_shape("codes", codes, (n, k // 8, 2), f"[N, K/8={k // 8}, 2]")
    _checks.check_shape("codebooks", codebooks, (2, 256, 1, 8), "[2, 256, 1, 8] (AQLM 2x8)")
    if not scales.dtype.is_floating_point or scales.numel() != n or scales.shape[0] != n:
        raise ValueError(f"scales: expected a floating tensor of shape [N={n}, 1, 1, 1], "
                         f"got {scales.dtype} {tuple(scales.shape)}")
    if bias is not None:
        _checks.check_tensor("bias", bias, ndim=1)
        _checks.check_shape("bias", bias, (n,), f"[N={n}]")
        if not bias.dtype.is_floating_point:
            raise ValueError(f"bias: expected a floating dtype, got {bias.dtype}")
    _checks.check_same_device(x=x, codes=codes, codebooks=codebooks, scales=scales, bias=bias)
    if codes.dtype in WIDE_CODE_DTYPES:
        if check_codes or _debug():
            lo, hi = int(codes.min()), int(codes.max())
            if lo < 0 or hi > 255:
                raise ValueError(f"codes: expected values in [0, 256) for dtype {codes.dtype}, got [{lo}, {hi}]")
        codes = codes.to(torch.uint8)
    codes = codes.contiguous()
    codebooks = codebooks.contiguous()
    scales = scales.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    return _vq_matmul(x, codes, codebooks, scales, bias)
