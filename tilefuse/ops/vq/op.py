"""``tilefuse.vq_matmul``: validation, launchers, dispatch, custom-op registration.

Kernels: ``kernels.py`` (``tl``: the CPU-tested decode schedule, the dequantize-in-registers MMA
kernel and the dequantize kernel), ``kernels_gluon.py`` (decode by ``gl.gather``),
``kernels_resident.py`` (decode with the table resident in shared memory), ``kernels_mma.py``
(decode for 2-16 tokens: weight tiles dequantized in registers from shared-memory codebooks, MMA),
``kernels_prefill.py`` (prefill on Hopper: the same dequantization into WGMMA's register operand).
Launch settings and dispatch points: ``configs.py``.
Spec: ``reference.py``.

Variants (``tilefuse.force(variant=...)``):

* ``"decode"``    -- one-launch table + lookup kernel: the resident Gluon kernel for 1-4 tokens
  with K a multiple of 16, else the ``gl.gather`` Gluon kernel (1-8 tokens); the ``tl`` schedule
  under the CPU interpreter
* ``"decode_tl"`` -- the same schedule written in ``tl`` (CPU-tested; slow on a GPU, see kernels.py)
* ``"mma"``       -- one launch: weight tiles dequantized in registers (codebooks copied into
  shared memory) times x^T on tensor cores, split-K (Gluon); the ``tl`` kernel under the interpreter
* ``"prefill"``   -- one launch, prefill tiles: on Hopper the WGMMA kernel (``kernels_prefill.py``:
  weight tiles dequantized into the tensor-core instruction's register operand, x and codes through
  a TMA ring, split-K where the tiles leave SMs idle); elsewhere the ``tl`` MMA kernel
* ``"small"``     -- one launch for small layers (``kernels_small.py``): a program owns 16 rows and
  the whole of K, split over its warps and summed in shared memory in a fixed order (no workspace,
  no atomics; Gluon); the ``tl`` twin under the interpreter
* ``"dequant"``   -- dequantize the layer into a scratch weight (one kernel), then cuBLAS

Default dispatch (``configs.decide``): a cost model fitted to every variant's measured times on
corpus layers picks, per (M, N, K), the fastest kernel that takes M tokens (decode <= 2, mma and
small <= 16, the WGMMA prefill <= 512) where it beats dequant + cuBLAS by a margin, else dequant + cuBLAS. fp16
and bf16 inputs run the kernels on CUDA; fp32 / fp64 inputs run the reference (dequantize, then a
cuBLAS GEMM on a GPU) on every device.

Split-K partial sums and arrival counters come from ``tilefuse._scratch`` (per stream, or per
captured call): two streams, threads or graphs calling layers of any shapes never share them.
"""

from __future__ import annotations

import functools
import importlib

import torch

from tilefuse import _checks, _dispatch, _env, _launch, _scratch
from tilefuse._backend import VARIANTS as _FAMILY_VARIANTS
from tilefuse._backend import check_interpretable, choose_backend, forced_state, forced_variant, interpreting, num_sms
from tilefuse._library import PlanCache, plan_key, tilefuse_op, use_dispatcher
from tilefuse.ops.vq import configs
from tilefuse.ops.vq.reference import dequantize, vq_matmul_reference

VARIANTS = _FAMILY_VARIANTS["vq"]
CODE_DTYPES = (torch.uint8, torch.int8)
WIDE_CODE_DTYPES = (torch.int16, torch.int32, torch.int64)
KERNEL_DTYPES = _checks.FLOAT16S     # fp32 / fp64 inputs run the reference


@functools.cache
def _kernel(module: str, name: str):
    """A kernel of ``tilefuse.ops.vq.<module>`` wrapped for cheap launches, or None when it is not
    importable here (a Gluon kernel without Gluon); looked up once."""
    try:
        return _launch.Kernel(getattr(importlib.import_module(f"tilefuse.ops.vq.{module}"), name))
    except Exception:  # pragma: no cover - depends on the Triton build
        return None


def _gluon_decode():
    """The gl.gather Gluon decode kernel (``kernels_gluon.py``), or None."""
    return _kernel("kernels_gluon", "vq_decode_gluon_kernel")


def _resident_decode():
    """The table-resident Gluon decode kernel (``kernels_resident.py``), or None."""
    return _kernel("kernels_resident", "vq_decode_resident_kernel")


def kernel_status(device: torch.device) -> dict[str, str]:
    """Which VQ kernel variants run on ``device`` ("ok" or why not)."""
    if device.type != "cuda":
        why = "ok (interpreter)" if interpreting() else "needs CUDA or TRITON_INTERPRET=1"
        return {"decode": why + "; tl schedule", "decode_tl": why, "mma": why + "; tl kernel", "prefill": why,
                "small": why + "; tl twin", "dequant": why}
    major, _ = torch.cuda.get_device_capability(device)
    mma_ok = "ok" if major >= 8 else f"needs sm_80+ (got sm_{major}x)"
    return {
        "decode": mma_ok if _gluon_decode() is not None else "Gluon not importable: falls back to decode_tl",
        "decode_tl": "ok (correct but slow on GPU: Triton lowers tl.gather to warp shuffles)",
        "mma": mma_ok if _mma_decode() is not None else "Gluon not importable: falls back to the tl kernel",
        "prefill": ("ok (WGMMA kernel; K a multiple of 64, else the tl kernel)" if major == 9 and
                    _wgmma_prefill() is not None else mma_ok + " (the tl kernel: the WGMMA kernel needs sm_90)"),
        "small": mma_ok if _small_kernel() is not None else "Gluon not importable: falls back to the tl twin",
        "dequant": "ok",
    }


def code_words(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K/8, 2] uint8/int8 (contiguous, K/8 even) -> int32 words [N, K/16]; word w of a
    row holds bytes c0(2w), c1(2w), c0(2w+1), c1(2w+1), low byte first (little endian)."""
    n = codes.shape[0]
    return codes.reshape(n, -1).view(torch.int32)


def resident_applies(m: int, k: int, device: torch.device) -> bool:
    """The resident kernel takes 1-4 tokens and an even number of groups (int32 code words)."""
    return (device.type == "cuda" and m <= configs.RESIDENT_MAX_TOKENS and (k // 8) % 2 == 0
            and _resident_decode() is not None)


def _split_scratch(device: torch.device, m_pad: int, n: int, blocks: int):
    """Zeroed fp32 partial sums [m_pad, N] and one int32 arrival counter per row block."""
    return _scratch.zeroed(device, (m_pad * n, torch.float32), (blocks, torch.int32))


_words_cache: dict = {}


def _code_words(codes: torch.Tensor) -> torch.Tensor:
    """:func:`code_words`, cached per codes tensor (a view: the cache keeps its storage alive, so
    the address cannot be reused by another tensor while it is cached)."""
    key = (codes.data_ptr(), codes.shape, codes.device)
    words = _words_cache.get(key)
    if words is None:
        if len(_words_cache) >= 1024:
            _words_cache.clear()
        words = _words_cache[key] = code_words(codes)
    return words


class _Call:
    """What a call with one argument layout runs, worked out once (validation included): the
    backend, the output shape, the variant and -- for the resident decode kernel -- its grid,
    scratch sizes, scalar arguments and constexprs. Identity-hashed: it is the launch's plan key
    (with the pointers' alignment)."""

    __slots__ = ("reference", "out_shape", "m", "variant", "resident", "grid", "scratch", "scalars", "meta",
                 "copies", "impl", "mma", "prefill", "block", "small")


def _resident_call(m: int, n: int, k: int, device: torch.device, has_bias: bool) -> _Call:
    """The resident decode kernel's launch for M contiguous rows of K in, M rows of N out."""
    cfg = configs.resident_config(m, n, k, num_sms(device))
    call = _Call()
    call.m, call.variant, call.resident = m, "decode", True
    call.grid = (cfg["chunks"], cfg["k_slices"], 1)
    split = cfg["k_slices"] > 1
    # split-K: zeroed fp32 partial sums [M_PAD, N] and one arrival counter per row chunk
    call.scratch = ((cfg["m_pad"] * n, torch.float32), (cfg["chunks"], torch.int32)) if split else None
    call.scalars = (m, n, k // 8, cfg["rows_per_prog"], cfg["k_slices"], k, k // 16, n)
    call.meta = dict(M_PAD=cfg["m_pad"], BLOCK_R=cfg["block_r"], AHEAD=cfg["ahead"], SPLIT=split, HAS_BIAS=has_bias,
                     NUM_WARPS=cfg["num_warps"], num_warps=cfg["num_warps"])
    return call


def _decode_key(call: _Call, x_align: int, code_view, codebooks, scales, bias, out_align: int) -> tuple:
    """The compiled-kernel key of a decode launch (resident or MMA): its plan and the 16-byte
    alignment of each pointer the kernel takes (x's and out's given as ``data_ptr() % 16``)."""
    return (call, x_align, code_view.data_ptr() % 16, codebooks.data_ptr() % 16, scales.data_ptr() % 16,
            bias is None or bias.data_ptr() % 16, out_align)


def _launch_resident(call: _Call, x, codes, codebooks, scales, bias, out):
    """x: M contiguous rows of K (any leading shape); scales: N contiguous; out: M contiguous rows of N."""
    ws, cnt = _scratch.zeroed(x.device, *call.scratch) if call.scratch else (out, out)
    words = _code_words(codes)
    key = _decode_key(call, x.data_ptr() % 16, words, codebooks, scales, bias, out.data_ptr() % 16)
    _resident_decode().launch(key, call.grid, x.device.index,
                              (x, words, codebooks, scales, bias if bias is not None else scales, out, ws, cnt),
                              call.scalars, call.meta)
    return out


class BoundDecode:
    """A one-launch decode kernel's launch for one weight and one input layout, everything but the
    input, the output, the scratch and the stream worked out once: the path ``VQLinear`` takes at
    decode sizes. An eager decode step calls every projection once per token, and the general
    path's plan lookup (the layout of five tensors), alignment key and argument marshalling cost
    more host time than the kernel takes on the GPU; here a call checks that it is the bound case
    (:meth:`accepts`: the weight tensors and pointers, x's layout, device and alignment, the
    thread's ``force()`` state, no gradient, not compiling, no launch hook), allocates the output
    and launches. Made by :func:`bind_decode`; any other call takes :func:`vq_matmul`."""

    __slots__ = ("weights", "pointers", "shape", "dtype", "device", "device_index", "forced", "out_shape",
                 "scratch", "args", "launch", "x_at", "out_at")

    def accepts(self, x: torch.Tensor, codes, codebooks, scales, bias) -> bool:
        if torch.compiler.is_compiling() or _launch._hooks_installed():
            return False
        weights = self.weights
        if (codes is not weights[0] or codebooks is not weights[1] or scales is not weights[2]
                or bias is not weights[3] or x.shape != self.shape or x.dtype != self.dtype):
            return False
        if (x.get_device() != self.device_index or not x.is_contiguous() or x.data_ptr() % 16
                or torch.cuda.current_device() != self.device_index or forced_state() != self.forced):
            return False
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *weights[1:])):
            return False
        return self.pointers == tuple(t.data_ptr() if t is not None else 0 for t in weights)

    def _bind(self, x: torch.Tensor, weights: tuple, out_shape: tuple) -> None:
        self.weights = weights
        self.pointers = tuple(t.data_ptr() if t is not None else 0 for t in weights)
        self.shape, self.dtype, self.device = x.shape, x.dtype, x.device
        self.device_index, self.forced = x.device.index, forced_state()
        self.out_shape = out_shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T (+ bias)`` for an ``x`` that :meth:`accepts`."""
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        args = list(self.args)
        args[3] = torch._C._cuda_getCurrentRawStream(self.device_index)
        args[self.x_at] = x.data_ptr()
        args[self.out_at] = out_ptr = out.data_ptr()
        if self.scratch:        # split-K partials and counters: this stream's (or this capture's)
            ws, cnt = _scratch.zeroed(self.device, *self.scratch)
            args[self.out_at + 1], args[self.out_at + 2] = ws.data_ptr(), cnt.data_ptr()
        else:
            args[self.out_at + 1] = args[self.out_at + 2] = out_ptr
        self.launch(*args)
        return out


class BoundSmall(BoundDecode):
    """:class:`BoundDecode` for the small-layer kernel, whose arguments have no workspace and no
    arrival counters (nothing to take per call but the output)."""

    __slots__ = ()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        args = list(self.args)
        args[3] = torch._C._cuda_getCurrentRawStream(self.device_index)
        args[self.x_at] = x.data_ptr()
        args[self.out_at] = out.data_ptr()
        self.launch(*args)
        return out


class BoundDequant(BoundDecode):
    """The dequantize + cuBLAS path bound the same way (where the cost model picks it at decode
    sizes: small layers, e.g. 256 x 1536 key/value projections): one dequantize launch into a fresh
    ``[N, K]`` buffer of x's dtype, then ``torch.mm`` / ``torch.addmm`` with the bias."""

    __slots__ = ("w_shape",)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.empty(self.w_shape, dtype=self.dtype, device=self.device)
        args = list(self.args)
        args[3] = torch._C._cuda_getCurrentRawStream(self.device_index)
        args[self.out_at] = w.data_ptr()
        self.launch(*args)
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        n, k = self.w_shape
        _matmul_dequantized(x.view(-1, k), w, self.weights[3], out.view(-1, n))
        return out


def bind_decode(x: torch.Tensor, codes: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None) -> BoundDecode | None:
    """A :class:`BoundDecode` for calls like ``vq_matmul(x, codes, codebooks, scales, bias)`` (made
    after one such call has run: it reuses that call's plan and compiled kernel), or None where
    that call does not run one of the one-launch decode kernels (the resident table kernel, 1-4
    tokens; the MMA kernel, up to 16) or the dequantize path at up to 16 tokens
    (:class:`BoundDequant`; a bias in x's dtype) on a 16-byte-aligned contiguous x with 1-byte
    codes and contiguous weights (the prefill path, the CPU, the interpreter, wide codes)."""
    if (not isinstance(codes, torch.Tensor) or codes.dtype not in CODE_DTYPES or not x.is_cuda
            or not x.is_contiguous() or x.data_ptr() % 16 or x.device.index != torch.cuda.current_device()):
        return None
    call = _plans.get(plan_key(x, codes, codebooks, scales, bias))
    if call is None or call.reference or call.copies or call.m == 0:
        return None
    if call.variant == "dequant" and call.mma is None and call.prefill is None:
        if call.m > configs.MMA_SWITCH_TOKENS:        # a prefill call keeps the layer's decode binding
            return None
        return _bind_dequant(x, call, codes, codebooks, scales, bias)
    if call.resident:                           # _launch_resident's launch
        launch_call, kernel, code_view = call, _resident_decode(), _code_words(codes)
    elif call.small is not None:                # _launch_small's (no workspace, no counters)
        if call.small.impl != "gluon":
            return None
        launch_call, kernel, code_view = call.small, _small_kernel(), _code_pairs(codes)
    elif call.prefill is None and call.mma is not None:       # _launch_mma's
        launch_call, kernel, code_view = call.mma, _mma_kernel(call.mma), _code_pairs(codes)
    else:
        return None
    compiled = kernel.compiled(_decode_key(launch_call, 0, code_view, codebooks, scales, bias, 0))
    if compiled is None:
        return None
    launch, head, tail = compiled
    bound = BoundSmall() if call.small is not None else BoundDecode()
    bound._bind(x, (codes, codebooks, scales, bias), call.out_shape)
    bound.scratch = launch_call.scratch
    # the launcher's arguments: grid, stream, head, then the kernel's (x, codes, codebooks, scales,
    # bias or scales, out, ws, cnt, scalars..., constexprs...) as both launchers pass them (the
    # small-layer kernel has no ws and cnt)
    tensors = [None, code_view.data_ptr(), codebooks.data_ptr(), scales.data_ptr(),
               (bias if bias is not None else scales).data_ptr(), None] + ([] if call.small is not None else [None, None])
    bound.args = (*launch_call.grid, None, *head, *tensors, *launch_call.scalars, *tail)
    bound.x_at = 4 + len(head)
    bound.out_at = bound.x_at + 5
    bound.launch = launch
    return bound


def _bind_dequant(x, call: _Call, codes, codebooks, scales, bias) -> BoundDequant | None:
    """:func:`bind_decode` for the dequantize path (``launch_dequant``'s launch, then cuBLAS)."""
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        return None
    n, k = codes.shape[0], x.shape[-1]
    compiled = _kernel("kernels", "vq_dequant_kernel").compiled(
        _dequant_key(x.dtype, codes, codebooks, scales, n, k, DEQUANT_LAUNCH))
    if compiled is None:
        return None
    launch, head, tail = compiled
    bound = BoundDequant()
    bound._bind(x, (codes, codebooks, scales, bias), call.out_shape)
    bound.scratch, bound.w_shape = None, (n, k)
    # the launcher's arguments: grid, stream, head, then the kernel's (codes, codebooks, scales, w,
    # n, groups, k // 4, k, constexprs...) as launch_dequant passes them
    tensors = [codes.data_ptr(), codebooks.data_ptr(), scales.data_ptr(), None]
    bound.args = (*_dequant_grid(n, k, DEQUANT_LAUNCH), None, *head, *tensors, n, k // 8, k // 4, k, *tail)
    bound.x_at = None
    bound.out_at = 4 + len(head) + 3
    bound.launch = launch
    return bound


def launch_decode(x2d, codes, codebooks, scales, bias, out, *, impl: str = "auto", block_n=None,
                  num_warps=None, split_k=None, convert_table: bool | None = None) -> torch.Tensor:
    """Run a one-launch decode kernel: ``out[:M] = x2d @ W^T (+ bias)`` for M <= 8 tokens.

    x2d: [M, K]; codes: [N, K/8, 2] uint8/int8 contiguous; scales: [N]; out: [M, N] (any contents).
    impl: "auto" (resident table where it applies, else gather), "resident", "gather" (Gluon,
    ``gl.gather`` per K step) or "tl" (the CPU-tested schedule). The keyword overrides configure
    the gather/tl kernels (tuning and tests).
    """
    m, k = x2d.shape
    n = codes.shape[0]
    if m > configs.DECODE_MAX_TOKENS:
        raise ValueError(f"x: the decode kernel takes at most {configs.DECODE_MAX_TOKENS} tokens, got {m}")
    if impl in ("auto", "resident") and resident_applies(m, k, x2d.device):
        call = _resident_call(m, n, k, x2d.device, bias is not None)
        if x2d.stride(0) != k or out.stride(0) != n:
            return out.copy_(_launch_resident(call, x2d.contiguous(), codes, codebooks, scales, bias,
                                              torch.empty(m, n, dtype=out.dtype, device=out.device)))
        return _launch_resident(call, x2d, codes, codebooks, scales, bias, out)
    if impl == "resident":
        raise ValueError(f"x: the resident decode kernel needs CUDA, at most {configs.RESIDENT_MAX_TOKENS} tokens "
                         f"and K a multiple of 16, got {m} tokens, K={k} on {x2d.device}")
    cfg = configs.gather_config(m, n, k, x2d.device.type == "cuda", num_sms(x2d.device))
    block_n = block_n or cfg["block_n"]
    convert_table = cfg["convert_table"] if convert_table is None else convert_table
    num_warps = num_warps or cfg["num_warps"]
    groups = k // 8
    gm = cfg["cols"] // cfg["m_pad"]
    groups_per_split = cfg["groups_per_split"]
    if split_k is not None or block_n != cfg["block_n"]:   # tuning overrides: recompute the split
        steps = -(-groups // gm)
        split = max(1, min(split_k or cfg["split_k"], steps))
        groups_per_split = -(-steps // split) * gm
    split = -(-groups // groups_per_split)
    row_blocks = -(-n // block_n)
    ws, cnt = _split_scratch(x2d.device, cfg["m_pad"], n, row_blocks) if split > 1 else (out, out)
    codes16 = codes.view(torch.int16).view(n, groups)
    grid = (row_blocks, split)
    args = (x2d, codes16, codebooks, scales, bias if bias is not None else scales, out, ws, cnt,
            m, n, groups, groups_per_split, split, x2d.stride(0), codes16.stride(0), out.stride(0))
    meta = dict(BLOCK_N=block_n, COLS=cfg["cols"], M_PAD=cfg["m_pad"], SPLIT=split > 1, HAS_BIAS=bias is not None)
    key = (x2d.device, x2d.dtype, codebooks.dtype, scales.dtype, None if bias is None else bias.dtype,
           m, n, k, groups_per_split, split, x2d.stride(0), out.stride(0), block_n, num_warps, convert_table,
           _launch.aligned(x2d, codes16, codebooks, scales, bias, out))
    kernel = _gluon_decode() if impl != "tl" and x2d.device.type == "cuda" else None
    if kernel is not None:
        kernel(key, grid, x2d.device.index, *args, **meta, NUM_WARPS=num_warps, CONVERT_TABLE=convert_table,
               num_warps=num_warps)
    else:
        _kernel("kernels", "vq_decode_kernel")(key, grid, x2d.device.index, *args, **meta, num_warps=num_warps)
    return out


def _mma_decode():
    """The Gluon MMA decode kernel (``kernels_mma.py``), or None."""
    return _kernel("kernels_mma", "vq_decode_mma_kernel")


def launch_mma(x2d, codes, codebooks, scales, bias, out, *, impl: str = "auto", **override) -> torch.Tensor:
    """Dequantize-in-registers MMA kernel, one launch: ``out = x2d @ W^T (+ bias)``.

    x2d: [M, K] (K/8 groups); codes: [N, K/8, 2] uint8/int8 contiguous; scales: [N]; out: [M, N]
    (any contents). impl: "auto" (the Gluon kernel on CUDA, the ``tl`` one under the interpreter),
    "gluon", or "tl" (``kernels.vq_mma_kernel``: the fused prefill variant on the GPU). ``override``
    replaces entries of ``configs.mma_config`` (tuning and tests; the split is recomputed)."""
    m, k = x2d.shape
    call = _mma_call(m, codes.shape[0], k, x2d.device, bias is not None, impl, x2d.stride(0), out.stride(0),
                     override)
    return _launch_mma(call, x2d, codes, codebooks, scales, bias, out)


def _mma_call(m: int, n: int, k: int, device: torch.device, has_bias: bool, impl: str, x_stride: int,
              out_stride: int, override: dict | None = None) -> _Call:
    """The MMA kernel's launch for M rows of K in (row stride ``x_stride``), M rows of N out."""
    if impl == "auto":
        impl = "gluon" if device.type == "cuda" and _mma_decode() is not None else "tl"
    mode = impl if device.type == "cuda" else "interpret"
    cfg = configs.mma_config(m, n, k, mode, num_sms(device))
    if override:
        cfg = {**cfg, **{key: v for key, v in override.items() if v is not None}}
        bg = cfg["block_k"] // 8 if impl == "tl" else 4 * cfg["krep"]
        steps, groups = -(-(k // 8) // bg), k // 8
        cfg["block_k"], cfg["token_tiles"], cfg["row_blocks"] = 8 * bg, -(-m // cfg["tokens"]), -(-n // cfg["block_n"])
        split = max(1, min(steps, cfg.get("split_k", 1))) if cfg["token_tiles"] == 1 else 1
        cfg["groups_per_split"] = -(-steps // split) * bg
        cfg["split_k"], cfg["even"] = -(-groups // cfg["groups_per_split"]), groups % bg == 0
    split = cfg["split_k"] > 1
    call = _Call()
    call.m, call.variant, call.resident, call.impl = m, "mma" if impl == "gluon" else "prefill", False, impl
    call.grid = (cfg["row_blocks"], cfg["split_k"], cfg["token_tiles"])
    # split-K: zeroed fp32 partial sums [tokens, N] and one arrival counter per row block
    call.scratch = ((cfg["tokens"] * n, torch.float32), (cfg["row_blocks"], torch.int32)) if split else None
    call.scalars = (m, n, k // 8, cfg["groups_per_split"], cfg["split_k"], x_stride, k // 8, out_stride)
    call.meta = dict(BLOCK_N=cfg["block_n"], TOKENS=cfg["tokens"], SPLIT=split, HAS_BIAS=has_bias,
                     num_warps=cfg["num_warps"])
    if impl == "gluon":
        call.meta.update(KREP=cfg["krep"], NUM_WARPS=cfg["num_warps"], EVEN=cfg["even"])
    else:
        call.meta.update(BLOCK_K=cfg["block_k"], num_stages=cfg["num_stages"])
    return call


def _mma_kernel(call: _Call) -> _launch.Kernel:
    """The MMA decode's kernel for a plan: the Gluon one, or its ``tl`` twin."""
    return _mma_decode() if call.impl == "gluon" else _kernel("kernels", "vq_mma_kernel")


def _launch_mma(call: _Call, x2d, codes, codebooks, scales, bias, out) -> torch.Tensor:
    ws, cnt = _scratch.zeroed(x2d.device, *call.scratch) if call.scratch else (out, out)
    codes16 = _code_pairs(codes)
    key = _decode_key(call, x2d.data_ptr() % 16, codes16, codebooks, scales, bias, out.data_ptr() % 16)
    _mma_kernel(call).launch(key, call.grid, x2d.device.index,
                             (x2d, codes16, codebooks, scales, bias if bias is not None else scales, out, ws, cnt),
                             call.scalars, call.meta)
    return out


def _small_kernel():
    """The Gluon small-layer kernel (``kernels_small.py``), or None."""
    return _kernel("kernels_small", "vq_small_kernel")


def launch_small(x2d, codes, codebooks, scales, bias, out, *, impl: str = "auto", **override) -> torch.Tensor:
    """The small-layer kernel, one launch: ``out = x2d @ W^T (+ bias)``, no workspace.

    x2d: [M, K] (any M: more than 16 tokens run token tiles); codes: [N, K/8, 2] uint8/int8
    contiguous; scales: [N]; out: [M, N] (any contents). impl: "auto" (the Gluon kernel on CUDA,
    the ``tl`` twin under the interpreter), "gluon" or "tl". ``override`` (``slices``, ``copies``,
    ``krep``, ``tokens``) replaces entries of ``configs.small_config`` (tuning and tests)."""
    m, k = x2d.shape
    call = _small_call(m, codes.shape[0], k, x2d.device, bias is not None, impl, x2d.stride(0), out.stride(0),
                       **override)
    return _launch_small(call, x2d, codes, codebooks, scales, bias, out)


def _gluon_or_tl(impl: str, device: torch.device, gluon_kernel, what: str) -> str:
    """``impl`` ("auto", "gluon" or "tl") resolved for ``device``: "auto" is the Gluon kernel on
    CUDA where it is importable (``gluon_kernel`` not None), else its ``tl`` twin; ValueError
    naming ``impl`` for another value, or for "gluon" off CUDA or without Gluon."""
    if impl == "auto":
        impl = "gluon" if device.type == "cuda" and gluon_kernel is not None else "tl"
    if impl not in ("gluon", "tl"):
        raise ValueError(f"impl: expected 'auto', 'gluon' or 'tl', got {impl!r}")
    if impl == "gluon" and (device.type != "cuda" or gluon_kernel is None):
        raise ValueError(f"impl: the Gluon {what} needs a CUDA GPU and Gluon, got {device}")
    return impl


def _small_call(m: int, n: int, k: int, device: torch.device, has_bias: bool, impl: str, x_stride: int,
                out_stride: int, **override) -> _Call:
    """The small-layer kernel's launch for M rows of K in (row stride ``x_stride``), M rows of N out."""
    impl = _gluon_or_tl(impl, device, _small_kernel(), "small-layer kernel")
    cfg = configs.small_config(m, n, k, impl == "gluon", num_sms(device),
                               **{key: int(v) for key, v in override.items() if v is not None})
    call = _Call()
    call.m, call.variant, call.resident, call.impl = m, "small", False, impl
    call.grid = cfg["grid"]
    call.scratch = None
    call.scalars = (m, n, k // 8, cfg["groups_per_slice"], x_stride, k // 8, out_stride)
    call.meta = dict(TOKENS=cfg["tokens"], KREP=cfg["krep"], ROW_TILES=cfg["row_tiles"], SLICES=cfg["slices"],
                     COPIES=cfg["copies"], HAS_BIAS=has_bias, EVEN=cfg["even"], num_warps=cfg["num_warps"])
    return call


def _launch_small(call: _Call, x2d, codes, codebooks, scales, bias, out) -> torch.Tensor:
    codes16 = _code_pairs(codes)
    key = _decode_key(call, x2d.data_ptr() % 16, codes16, codebooks, scales, bias, out.data_ptr() % 16)
    kernel = _small_kernel() if call.impl == "gluon" else _kernel("kernels_small", "vq_small_tl_kernel")
    kernel.launch(key, call.grid, x2d.device.index,
                  (x2d, codes16, codebooks, scales, bias if bias is not None else scales, out), call.scalars, call.meta)
    return out


def _wgmma_prefill():
    """The Gluon WGMMA prefill kernel (``kernels_prefill.py``), or None."""
    return _kernel("kernels_prefill", "vq_prefill_kernel")


def _wgmma_prefill_ws():
    """The warp-specialized form of the WGMMA prefill kernel, or None."""
    return _kernel("kernels_prefill", "vq_prefill_ws_kernel")


def wgmma_prefill_applies(k: int, device: torch.device) -> bool:
    """The WGMMA prefill kernel runs on Hopper (sm_90) with K a multiple of its 64-input step."""
    return (device.type == "cuda" and k % 64 == 0 and torch.cuda.get_device_capability(device)[0] == 9
            and _wgmma_prefill() is not None)


def launch_prefill(x2d, codes, codebooks, scales, bias, out, *, impl: str = "auto", **override) -> torch.Tensor:
    """The fused prefill kernel, one launch: ``out = x2d @ W^T (+ bias)``.

    x2d: [M, K]; codes: [N, K/8, 2] uint8/int8 contiguous; scales: [N]; out: [M, N] (any contents).
    impl: "auto" (the WGMMA kernel where :func:`wgmma_prefill_applies`, else the ``tl`` twin),
    "wgmma" or "tl". ``override`` (``block_m``, ``stages``, ``num_warps``, ``split_k``, ``ws``)
    replaces entries of ``configs.wgmma_prefill_config`` (tuning and tests)."""
    m, k = x2d.shape
    n = codes.shape[0]
    if impl == "tl" or (impl == "auto" and not wgmma_prefill_applies(k, x2d.device)):
        return launch_mma(x2d, codes, codebooks, scales, bias, out, impl="tl")
    if not wgmma_prefill_applies(k, x2d.device):
        raise ValueError(f"x: the WGMMA prefill kernel needs an sm_90 GPU and K a multiple of 64, got K={k} on "
                         f"{x2d.device}")
    call = _prefill_call(m, n, k, x2d.device, bias is not None, out.stride(0), **override)
    return _launch_prefill(call, x2d, codes, codebooks, scales, bias, out)


def _prefill_call(m: int, n: int, k: int, device: torch.device, has_bias: bool, out_stride: int, **override) -> _Call:
    """The WGMMA prefill kernel's launch for M rows of K in, M rows of N out (row stride ``out_stride``)."""
    override = {key: (-1 if key == "ws" else 0) if v is None else v for key, v in override.items()}
    cfg = configs.wgmma_prefill_config(m, n, k, num_sms(device), **override)
    call = _Call()
    call.m, call.variant, call.resident, call.impl = m, "prefill", False, "wgmma_ws" if cfg["ws"] else "wgmma"
    call.grid = cfg["grid"]
    call.block = ([cfg["block_m"], 64], [cfg["block_n"], 8])
    # split-K: zeroed fp32 partial sums [M, N] and one arrival counter per output tile (per consumer
    # warpgroup in the warp-specialized form)
    counters = call.grid[0] * call.grid[1] * (2 if cfg["ws"] else 1)
    call.scratch = ((m * n, torch.float32), (counters, torch.int32)) if cfg["split_k"] > 1 else None
    call.scalars = (m, n, k // 8, cfg["groups_per_split"], cfg["split_k"], out_stride)
    call.meta = configs.wgmma_prefill_meta(cfg, has_bias)
    return call


def _launch_prefill(call: _Call, x2d, codes, codebooks, scales, bias, out) -> torch.Tensor:
    """x2d: [M, K] with unit column stride (TMA: a 16-byte aligned base and row stride); codes
    contiguous with a 16-byte aligned base (TMA; K a multiple of 64 makes its rows 16-byte aligned)."""
    if x2d.data_ptr() % 16 or (x2d.stride(0) * x2d.element_size()) % 16:
        x2d = x2d.contiguous() if not x2d.is_contiguous() else x2d.clone()
    codes16 = _code_pairs(codes)
    if codes16.data_ptr() % 16:     # a view at an odd offset: TMA cannot read it
        return launch_dequant(x2d, codes, codebooks, scales, bias, out)
    m, k = x2d.shape
    n, groups = codes16.shape
    x_desc = _launch.descriptor(x2d, [m, k], [x2d.stride(0), 1], call.block[0], gluon=True)
    c_desc = _launch.descriptor(codes16, [n, groups], [groups, 1], call.block[1], gluon=True)
    # the call plan pins dtypes and strides (its plan key), so the pointers' alignment completes the key
    key = (call, codebooks.data_ptr() % 16, scales.data_ptr() % 16, bias is None or bias.data_ptr() % 16,
           out.data_ptr() % 16)
    ws, cnt = _scratch.zeroed(x2d.device, *call.scratch) if call.scratch else (out, out)
    kernel = _wgmma_prefill_ws() if call.impl == "wgmma_ws" else _wgmma_prefill()
    kernel.launch(key, call.grid, x2d.device.index,
                  (x_desc, c_desc, codebooks, scales, bias if bias is not None else scales, out, ws, cnt),
                  call.scalars, call.meta)
    return out


def _code_pairs(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., N, K/8, 2] (uint8/int8; stacked experts lead with E) as int16 [... * N, K/8],
    cached per codes tensor like :func:`_code_words`."""
    key = ("pairs", codes.data_ptr(), codes.shape, codes.device)
    pairs = _words_cache.get(key)
    if pairs is None:
        if len(_words_cache) >= 1024:
            _words_cache.clear()
        pairs = _words_cache[key] = codes.view(torch.int16).view(-1, codes.shape[-2])
    return pairs


DEQUANT_LAUNCH = dict(BLOCK_N=16, BLOCK_G=64, num_warps=4)    # vq_dequant_kernel's tile


def _dequant_key(x_dtype, codes, codebooks, scales, n: int, k: int, meta: dict) -> tuple:
    """The compiled-kernel key of a dequantize launch: dtypes, shape, tile and the pointers' alignment."""
    return (x_dtype, codebooks.dtype, scales.dtype, codes.device, n, k, meta["BLOCK_N"], meta["BLOCK_G"],
            meta["num_warps"], codes.data_ptr() % 16, codebooks.data_ptr() % 16, scales.data_ptr() % 16)


def _dequant_grid(n: int, k: int, meta: dict) -> tuple:
    return (-(-n // meta["BLOCK_N"]), -(-(k // 8) // meta["BLOCK_G"]), 1)


def launch_dequant(x2d, codes, codebooks, scales, bias, out, *, block_n: int = DEQUANT_LAUNCH["BLOCK_N"],
                   block_g: int = DEQUANT_LAUNCH["BLOCK_G"],
                   num_warps: int = DEQUANT_LAUNCH["num_warps"]) -> torch.Tensor:
    """Dequantize W (one Triton kernel) into a scratch ``[N, K]`` in x's dtype, then cuBLAS.
    x2d: [M, K]; scales: N contiguous; out: [M, N]."""
    m, k = x2d.shape
    n = codes.shape[0]
    w = torch.empty(n, k, dtype=x2d.dtype, device=x2d.device)
    meta = dict(BLOCK_N=block_n, BLOCK_G=block_g, num_warps=num_warps)
    codes8 = codes if codes.dtype == torch.uint8 else codes.view(torch.uint8)   # AQLM's int8 codes: same bits
    _kernel("kernels", "vq_dequant_kernel").launch(
        _dequant_key(x2d.dtype, codes, codebooks, scales, n, k, meta), _dequant_grid(n, k, meta), x2d.device.index,
        (codes8, codebooks, scales, w), (n, k // 8, k // 4, k), meta)
    return _matmul_dequantized(x2d, w, bias, out)


def _matmul_dequantized(x2d, w, bias, out) -> torch.Tensor:
    """cuBLAS on the dequantized weight: ``out = x2d @ w^T (+ bias)``; through ``_scratch.blas``, so a
    CUDA graph that captures it holds a cuBLAS workspace of its own (graphs replayed at once)."""
    if bias is None:
        return _scratch.blas(torch.mm, x2d, w.t(), out=out)
    return _scratch.blas(torch.addmm, bias.to(x2d.dtype), x2d, w.t(), out=out)


def choose_variant(m: int, k: int = 0, device: torch.device | None = None, n: int | None = None) -> str:
    """The variant a call on ``m`` tokens of ``k`` inputs and ``n`` outputs on ``device`` runs: the
    one pinned by ``force()``, else the cost model's pick (``configs.decide``; the H200's figures
    for a CPU, as the interpreter runs), or without ``n`` the token thresholds of
    ``configs.default_variant``."""
    forced = forced_variant("vq")
    if forced:
        return forced
    wgmma = device is not None and wgmma_prefill_applies(k, device)
    if n is None:
        return configs.default_variant(m, configs.MMA_SWITCH_TOKENS < m <= configs.PREFILL_MAX_TOKENS and wgmma)
    return decision(m, n, k, device, wgmma).variant


def swiglu_decision(m: int, n: int, k: int, device: torch.device | None) -> bool:
    """Whether ``vq_swiglu`` fuses on this size: ``force(variant=...)``'s pin (fused only for
    "small"), else ``configs.decide_swiglu`` for this device's chip and SM count."""
    forced = forced_variant("vq")
    if forced:
        return forced == "small"
    wgmma = device is not None and wgmma_prefill_applies(k, device)
    return configs.decide_swiglu(m, n, k, wgmma, *_chip_args(device))


def decision(m: int, n: int, k: int, device: torch.device | None, wgmma: bool) -> _dispatch.Choice:
    """``configs.decide`` for this device's chip and SM count."""
    return configs.decide(m, n, k, wgmma, *_chip_args(device))


def _chip_args(device: torch.device | None) -> tuple:
    """The cost model's (chip, SM count) for ``device``; none off CUDA (the models' defaults: the
    H200's figures, as the interpreter runs)."""
    if device is not None and device.type == "cuda":
        return _dispatch.chip(device), num_sms(device)
    return ()


def _reference(x, codes, codebooks, scales, bias):
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    return vq_matmul_reference(x, codes, codebooks, scales, bias, compute_dtype=compute)


def _vq_matmul_fake(x, codes, codebooks, scales, bias):
    return x.new_empty(*x.shape[:-1], codes.shape[0])


def _setup_backward(ctx, inputs, output):
    x, codes, codebooks, scales, bias = inputs
    ctx.save_for_backward(x, codes, codebooks, scales)
    ctx.has_bias = bias is not None
    ctx.bias_dtype = None if bias is None else bias.dtype


def _vq_matmul_backward(ctx, grad_out):
    """Gradients of ``y = x W^T + b``, ``W[n, 8g:8g+8] = s_n (C0[a_ng] + C1[b_ng])`` (fp32, or fp64
    for fp64 inputs): ``dx = dy W``; with ``G = dy^T x`` (``[N, K]``, per group ``G_ng``):
    ``dC_c[e] = sum over (n, g) with code e of s_n G_ng``, ``ds_n = sum_g <G_ng, C0[a] + C1[b]>``,
    ``db = sum dy``. Codes get no gradient."""
    x, codes, codebooks, scales = ctx.saved_tensors
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    n, groups = codes.shape[0], codes.shape[1]
    dy = grad_out.reshape(-1, n).to(compute)
    d_x = d_books = d_scales = d_bias = None
    if ctx.needs_input_grad[0]:
        w = dequantize(codes, codebooks, scales, dtype=compute)
        d_x = (dy @ w).reshape(x.shape).to(x.dtype)
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
        g = (dy.T @ x.reshape(-1, x.shape[-1]).to(compute)).reshape(n, groups, 8)      # [N, G, 8]
        index = codes.to(torch.int64) & 0xFF                                            # [N, G, 2]
        s = scales.reshape(n, 1, 1).to(compute)
        if ctx.needs_input_grad[2]:
            d_books = torch.zeros(2, 256, 8, dtype=compute, device=x.device)
            for c in range(2):
                d_books[c].index_add_(0, index[..., c].reshape(-1), (s * g).reshape(-1, 8))
            d_books = d_books.reshape(codebooks.shape).to(codebooks.dtype)
        if ctx.needs_input_grad[3]:
            books = codebooks.to(compute)[:, :, 0, :]
            u = books[0][index[..., 0]] + books[1][index[..., 1]]                        # [N, G, 8]
            d_scales = (g * u).sum(dim=(1, 2)).reshape(scales.shape).to(scales.dtype)
    if ctx.has_bias and ctx.needs_input_grad[4]:
        d_bias = dy.sum(0).to(ctx.bias_dtype)
    return d_x, None, d_books, d_scales, d_bias


@tilefuse_op("vq_matmul", fake=_vq_matmul_fake, backward=_vq_matmul_backward, setup_context=_setup_backward)
def _vq_matmul_op(x: torch.Tensor, codes: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    return _run(_plan_call(x, codes, codebooks, scales, bias), x, codes, codebooks, scales, bias)


_plans = PlanCache()


def _plan_call(x, codes, codebooks, scales, bias) -> _Call:
    key = plan_key(x, codes, codebooks, scales, bias)
    call = _plans.get(key) if key is not None else None
    if call is not None:
        return call
    _validate(x, codes, codebooks, scales, bias)
    n, k = codes.shape[0], x.shape[-1]
    m = x.numel() // k if k else 0
    if m == 0 and k:        # no tokens (an MoE expert no token was routed to): an empty output, no launch
        return _plans.remember(key, _empty_call(x, n))
    reference = x.dtype not in KERNEL_DTYPES or n == 0 or k == 0 or choose_backend(x.device) != "triton"
    if not reference:
        check_interpretable("x", x.dtype)
    variant = choose_variant(m, k, x.device, n) if not reference else None
    if variant == "decode" and resident_applies(m, k, x.device):   # decode sizes: no reshapes
        call = _resident_call(m, n, k, x.device, bias is not None)
    else:
        call = _Call()
        call.m, call.variant, call.resident = m, variant, False
    # the fused kernels' launch, planned once (x is made contiguous before it runs)
    call.prefill = (_prefill_call(m, n, k, x.device, bias is not None, n)
                    if variant == "prefill" and wgmma_prefill_applies(k, x.device) else None)
    call.mma = (_mma_call(m, n, k, x.device, bias is not None, "auto" if variant == "mma" else "tl", k, n)
                if variant in ("mma", "prefill") and call.prefill is None else None)
    call.small = _small_call(m, n, k, x.device, bias is not None, "auto", k, n) if variant == "small" else None
    call.reference = reference
    call.out_shape = (*x.shape[:-1], n)
    # the kernels read codes, codebooks, scales and bias as dense arrays
    call.copies = any(t is not None and not t.is_contiguous() for t in (codes, codebooks, scales, bias))
    return _plans.remember(key, call)


def _empty_call(x: torch.Tensor, n: int) -> _Call:
    """The plan of a call on no tokens (x ``[..., 0, ..., K]``): ``_run`` returns an empty
    ``[..., N]`` in x's dtype; the cost model is not consulted (it has no time for no work)."""
    call = _Call()
    call.m, call.variant, call.resident, call.reference, call.copies = 0, "empty", False, False, False
    call.prefill = call.mma = call.small = None
    call.out_shape = (*x.shape[:-1], n)
    return call


def _run(call: _Call, x, codes, codebooks, scales, bias) -> torch.Tensor:
    if call.reference:
        return _reference(x, codes, codebooks, scales, bias)
    out = torch.empty(call.out_shape, dtype=x.dtype, device=x.device)
    m = call.m
    if m == 0:
        return out
    if not x.is_contiguous():
        x = x.contiguous()
    if call.resident:
        return _launch_resident(call, x, codes, codebooks, scales, bias, out)
    n, k = call.out_shape[-1], x.shape[-1]
    x2d, out2d = x.view(m, k), out.view(m, n)
    if call.variant == "dequant":
        launch_dequant(x2d, codes, codebooks, scales, bias, out2d)     # scales: N contiguous values
        return out
    scales_1d = scales.view(n)
    if call.small is not None:
        _launch_small(call.small, x2d, codes, codebooks, scales_1d, bias, out2d)
    elif call.prefill is not None:
        _launch_prefill(call.prefill, x2d, codes, codebooks, scales_1d, bias, out2d)
    elif call.mma is not None:
        _launch_mma(call.mma, x2d, codes, codebooks, scales_1d, bias, out2d)
    else:
        impl = "auto" if call.variant == "decode" else "tl"
        step = configs.DECODE_MAX_TOKENS
        for start in range(0, m, step):  # forced decode on more tokens: 8 at a time
            stop = min(m, start + step)
            launch_decode(x2d[start:stop], codes, codebooks, scales_1d, bias, out2d[start:stop], impl=impl)
    return out


def _validate(x, codes, codebooks, scales, bias) -> None:
    _checks.check_tensor("x", x, dtypes=_checks.FLOATS, min_ndim=1)
    _checks.check_tensor("codes", codes, dtypes=CODE_DTYPES + WIDE_CODE_DTYPES, ndim=3)
    _checks.check_tensor("codebooks", codebooks, dtypes=_checks.FLOATS, ndim=4)
    _checks.check_tensor("scales", scales, min_ndim=1)
    k = x.shape[-1]
    _checks.check_multiple("x", k, 8, "K (last dimension)")
    n = codes.shape[0]
    _checks.check_shape("codes", codes, (n, k // 8, 2), f"[N, K/8={k // 8}, 2]")
    _checks.check_shape("codebooks", codebooks, (2, 256, 1, 8), "[2, 256, 1, 8] (AQLM 2x8)")
    if not scales.dtype.is_floating_point or scales.numel() != n or (n and scales.shape[0] != n):
        raise ValueError(f"scales: expected a floating tensor of shape [N={n}, 1, 1, 1], "
                         f"got {scales.dtype} {tuple(scales.shape)}")
    if bias is not None:
        _checks.check_tensor("bias", bias, ndim=1)
        _checks.check_shape("bias", bias, (n,), f"[N={n}]")
        if not bias.dtype.is_floating_point:
            raise ValueError(f"bias: expected a floating dtype, got {bias.dtype}")
    _checks.check_same_device(x=x, codes=codes, codebooks=codebooks, scales=scales, bias=bias)


def check_code_range(codes: torch.Tensor) -> None:
    """Wide (int16/32/64) codes lie in [0, 256): reads the codes (a host sync)."""
    if codes.numel():
        lo, hi = (int(v) for v in torch.aminmax(codes))
        if lo < 0 or hi > 255:
            raise ValueError(f"codes: expected values in [0, 256) for dtype {codes.dtype}, got [{lo}, {hi}]")


def vq_matmul(x: torch.Tensor, codes: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor,
              bias: torch.Tensor | None = None, *, check_contents: bool | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for a 2-bit weight in AQLM's 2x8 format, never materializing ``W``.

    ``W[n, 8g:8g+8] = scales[n] * (C0[codes[n, g, 0]] + C1[codes[n, g, 1]])``.

    Parameters
    ----------
    x : [..., K], K a multiple of 8. fp16 or bf16 run the kernels on CUDA; fp32 / fp64 run the
        PyTorch reference (dequantize, then a GEMM) on every device.
    codes : [N, K/8, 2] uint8, or int8 as AQLM stores them (two's complement: -1 is code 255).
        A wider integer dtype (int16/32/64) is narrowed to uint8; its values must lie in [0, 256).
    codebooks : [2, 256, 1, 8], any floating dtype (fp32 as :func:`tilefuse.quantize` returns
        them, or fp16/bf16 as AQLM stores them). The resident decode kernel, the dequantize path
        and the reference compute with them at their own precision; the tensor-core table kernels
        (MMA decode, 5-8 tokens forced, K/8 odd, prefill) round them to x's dtype. The MMA and
        prefill kernels round each ``C0[a] + C1[b]`` to x's dtype and apply the row scale to the
        fp32 sums; where that sum could overflow x's dtype (fp16 codebooks with entries above
        32752) they scale the codebooks by a power of two and the row scale back (exact), so the
        result matches the reference whenever the codebooks' range fits x's dtype's.
    scales : [N, 1, 1, 1] (or [N]) floating point, per output row.
    bias : [N] floating point or None.
    check_contents : read the codes back to check the range of wide codes (a host sync); default
        ``TILEFUSE_DEBUG``. Skipped while ``torch.compile`` traces and for meta / fake tensors
        (nothing to read).

    Returns
    -------
    [..., N] in x's dtype. Accumulation is fp32. The path is the cost model's per (M, N, K)
    (``configs.decide``; ``tilefuse.explain`` shows it): the one-launch table-lookup decode kernel
    (1-2 tokens), the one-launch MMA decode kernel (weight tiles dequantized in registers, up to
    16), on Hopper the one-launch WGMMA prefill kernel (up to 512), where one is predicted faster
    than the baseline by 10 %; else the weight is dequantized into a scratch [N, K] (one kernel)
    and cuBLAS runs. No tokens (x ``[..., 0, ..., K]``, an MoE expert no token was routed to):
    an empty ``[..., N]``, no launch. Under ``torch.compile`` (static or dynamic shapes) the path
    is picked when the compiled code runs, on the concrete sizes.
    Differentiable in ``x``, ``codebooks``, ``scales`` and ``bias`` (the backward runs in PyTorch).
    """
    if not isinstance(codes, torch.Tensor) or codes.dtype in WIDE_CODE_DTYPES:
        _validate(x, codes, codebooks, scales, bias)
        checks = _env.settings.debug if check_contents is None else check_contents
        if checks and not _checks.contents_unreadable(codes):
            check_code_range(codes)
        codes = codes.to(torch.uint8)
    if torch.compiler.is_compiling():
        # traced: metadata checks and the custom op only. The plan (the cost model's pick per M,
        # cached by exact sizes) is made by the op's implementation at run time, on concrete
        # sizes: with dynamic shapes M is symbolic here, and the pick cannot be traced.
        _validate(x, codes, codebooks, scales, bias)
        codes, codebooks, scales, bias = (t if t is None else t.contiguous() for t in (codes, codebooks, scales, bias))
        return _vq_matmul_op(x, codes, codebooks, scales, bias)
    call = _plan_call(x, codes, codebooks, scales, bias)
    if call.copies:
        codes, codebooks, scales, bias = (t if t is None else t.contiguous() for t in (codes, codebooks, scales, bias))
        call = _plan_call(x, codes, codebooks, scales, bias)
    if use_dispatcher(x, codebooks, scales, bias):
        return _vq_matmul_op(x, codes, codebooks, scales, bias)
    return _run(call, x, codes, codebooks, scales, bias)


def explain(x: torch.Tensor, codes: torch.Tensor, codebooks: torch.Tensor, scales: torch.Tensor,
            bias: torch.Tensor | None = None, **_) -> _dispatch.Choice:
    """The path ``vq_matmul(x, codes, codebooks, scales, bias)`` runs and why (``tilefuse.explain``).
    Every variant that takes the call's tokens is listed with its predicted time
    (``configs.decide``: the fastest kernel where it beats dequant + cuBLAS by ``configs.MARGIN``)."""
    call = _plan_call(x, codes, codebooks, scales, bias)      # the op's own plan: its path, forced or not
    n, k, m = codes.shape[0], x.shape[-1], call.m
    problem = {"M": m, "N": n, "K": k, "dtype": str(x.dtype).removeprefix("torch."), "device": str(x.device)}
    if call.reference:
        return _dispatch.Choice("vq", problem, "reference", None, "reference")
    if call.variant == "empty":
        return _dispatch.Choice("vq", problem, "empty", None, "no tokens: an empty output, no launch")
    wgmma = wgmma_prefill_applies(k, x.device)
    choice = decision(m, n, k, x.device, wgmma)
    variant = call.variant
    detail = variant
    if variant == "decode":
        detail = "decode (resident table)" if call.resident else "decode (gather)"
    elif variant == "prefill" and not wgmma:
        detail = "prefill (tl: the WGMMA kernel needs a Hopper GPU and K a multiple of 64)"
    source = "forced" if forced_variant("vq") else choice.source
    candidates = tuple(_dispatch.Candidate(c.variant, c.config, c.predicted_us, detail if c.variant == variant else c.note)
                       for c in choice.candidates)
    return _dispatch.Choice("vq", problem, variant, None, source, candidates)


# --------------------------------------------------------------------------------------------------
# tilefuse.vq_swiglu: the 2-bit gate/up projection with the SwiGLU epilogue in one launch
# (kernels_swiglu.py), where configs.decide_swiglu predicts it faster than two vq_matmul calls;
# tilefuse.nn.VQSwiGLUMLP (and so patch_vq) runs it.

from tilefuse._library import no_backward  # noqa: E402
from tilefuse.ops.vq.reference import vq_swiglu_reference  # noqa: E402

# copies of each codebook entry per weight in shared memory: two weights' four codebooks at 4
# copies take the 64 KB the small-layer kernel's 8 copies take (a first guess: unmeasured)
SWIGLU_COPIES = 4
# the fused kernel is considered up to this many tokens (the small-layer kernel's limit in the cost
# model); more tokens run the two projections through vq_matmul's dispatch, then SiLU * up
SWIGLU_MAX_TOKENS = configs.SMALL_MAX_TOKENS


def _swiglu_kernel():
    """The Gluon fused gate/up kernel (``kernels_swiglu.py``), or None."""
    return _kernel("kernels_swiglu", "vq_swiglu_kernel")


def _swiglu_epilogue_kernel():
    """The unfused path's ``silu(g) * u`` pass (``kernels_swiglu.vq_swiglu_epilogue_kernel``)."""
    return _kernel("kernels_swiglu", "vq_swiglu_epilogue_kernel")


SWIGLU_EPILOGUE_BLOCK = 1024    # elements per program of the unfused path's epilogue


def silu_mul_outputs(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of two projections' outputs (the same shape and 16-bit dtype, contiguous,
    on CUDA or under the interpreter), in fp32 with one rounding, one launch
    (``kernels_swiglu.vq_swiglu_epilogue_kernel``): the unfused path's epilogue. Returns a new
    tensor of gate's shape and dtype."""
    out = torch.empty_like(gate)
    numel = gate.numel()
    if numel:
        grid = (-(-numel // SWIGLU_EPILOGUE_BLOCK), 1, 1)
        _swiglu_epilogue_kernel().launch((numel % 16 == 0, gate.data_ptr() % 16, up.data_ptr() % 16,
                                          out.data_ptr() % 16, gate.dtype), grid, gate.device.index,
                                         (gate, up, out), (numel,), dict(BLOCK=SWIGLU_EPILOGUE_BLOCK, num_warps=4))
    return out


def swiglu_fuses(x: torch.Tensor, gate_codes: torch.Tensor, gate_codebooks: torch.Tensor, gate_scales: torch.Tensor,
                 up_codes: torch.Tensor, up_codebooks: torch.Tensor, up_scales: torch.Tensor,
                 gate_bias: torch.Tensor | None, up_bias: torch.Tensor | None) -> bool | None:
    """What :func:`vq_swiglu` runs on these arguments: True for the fused kernel, False for two
    ``vq_matmul`` calls and :func:`silu_mul_outputs`, None for anything else (the reference, no
    tokens). Validates as ``vq_swiglu`` does (its plan, cached per argument layout)."""
    call = _plan_swiglu(x, gate_codes, gate_codebooks, gate_scales, up_codes, up_codebooks, up_scales, gate_bias,
                        up_bias)
    return None if call.reference or call.m == 0 else call.fused


class _SwiGLUCall:
    """A ``vq_swiglu`` call's plan per argument layout: the reference or not, the output shape, the
    token count, whether the fused kernel runs (``fused``: its launch's grid, scalars, constexprs)."""

    __slots__ = ("reference", "out_shape", "m", "fused", "impl", "grid", "scalars", "meta")


def _swiglu_call(m: int, n: int, k: int, device: torch.device, gate_bias: bool, up_bias: bool, impl: str,
                 x_stride: int, out_stride: int, **override) -> _SwiGLUCall:
    """The fused kernel's launch for M rows of K in (row stride ``x_stride``), M rows of N out: the
    small-layer kernel's tiles (``configs.small_config``) with :data:`SWIGLU_COPIES` copies."""
    impl = _gluon_or_tl(impl, device, _swiglu_kernel(), "fused gate/up kernel")
    override = {key: int(v) for key, v in override.items() if v is not None}
    override.setdefault("copies", SWIGLU_COPIES)
    cfg = configs.small_config(m, n, k, impl == "gluon", num_sms(device), **override)
    call = _SwiGLUCall()
    call.reference, call.m, call.fused, call.impl = False, m, True, impl
    call.out_shape = (m, n)
    call.grid = cfg["grid"]
    call.scalars = (m, n, k // 8, cfg["groups_per_slice"], x_stride, k // 8, out_stride)
    call.meta = dict(TOKENS=cfg["tokens"], KREP=cfg["krep"], ROW_TILES=cfg["row_tiles"], SLICES=cfg["slices"],
                     COPIES=cfg["copies"], GATE_BIAS=gate_bias, UP_BIAS=up_bias, EVEN=cfg["even"],
                     num_warps=cfg["num_warps"])
    return call


def _launch_swiglu(call: _SwiGLUCall, x2d, gate_codes, gate_codebooks, gate_scales, up_codes, up_codebooks,
                   up_scales, gate_bias, up_bias, out) -> torch.Tensor:
    """x2d: [M, K] unit column stride; codes contiguous; scales: N contiguous; out: [M, N]."""
    tensors = (x2d, _code_pairs(gate_codes), gate_codebooks, gate_scales,
               gate_bias if gate_bias is not None else gate_scales, _code_pairs(up_codes), up_codebooks, up_scales,
               up_bias if up_bias is not None else up_scales, out)
    key = (call, *(t.data_ptr() % 16 for t in tensors))     # the plan pins dtypes and strides
    kernel = _swiglu_kernel() if call.impl == "gluon" else _kernel("kernels_swiglu", "vq_swiglu_tl_kernel")
    kernel.launch(key, call.grid, x2d.device.index, tensors, call.scalars, call.meta)
    return out


def launch_swiglu(x2d, gate_codes, gate_codebooks, gate_scales, up_codes, up_codebooks, up_scales, gate_bias,
                  up_bias, out, *, impl: str = "auto", **override) -> torch.Tensor:
    """The fused gate/up kernel, one launch: ``out = silu(x2d Wg^T + bg) * (x2d Wu^T + bu)``.

    x2d: [M, K] (any M: more than 16 tokens run token tiles); codes: [N, K/8, 2] uint8/int8
    contiguous, both weights' the same shape; scales: [N]; biases: [N] or None; out: [M, N] (any
    contents). impl: "auto" (the Gluon kernel on CUDA, the ``tl`` twin under the interpreter),
    "gluon" or "tl". ``override`` (``slices``, ``copies``, ``krep``, ``tokens``, ``row_tiles``)
    replaces entries of the launch settings (tuning and tests)."""
    m, k = x2d.shape
    call = _swiglu_call(m, gate_codes.shape[0], k, x2d.device, gate_bias is not None, up_bias is not None, impl,
                        x2d.stride(0), out.stride(0), **override)
    return _launch_swiglu(call, x2d, gate_codes, gate_codebooks, gate_scales, up_codes, up_codebooks, up_scales,
                          gate_bias, up_bias, out)


_WEIGHT_ARGS = ("codes", "codebooks", "scales", "bias")


def _validate_swiglu(x, gate_codes, gate_codebooks, gate_scales, up_codes, up_codebooks, up_scales, gate_bias,
                     up_bias) -> None:
    """:func:`_validate` per projection, its errors naming ``gate_*`` / ``up_*``; the up projection's
    N must be the gate's (checked before the rest of the up weight; K is x's for both)."""
    for prefix, weight in (("gate", (gate_codes, gate_codebooks, gate_scales, gate_bias)),
                           ("up", (up_codes, up_codebooks, up_scales, up_bias))):
        if prefix == "up" and isinstance(up_codes, torch.Tensor) and up_codes.dim() >= 1 \
                and up_codes.shape[0] != gate_codes.shape[0]:
            raise ValueError(f"up_codes: expected N={gate_codes.shape[0]} rows as gate_codes has (gate and up "
                             f"project to the same N), got shape {tuple(up_codes.shape)}")
        try:
            _validate(x, *weight)
        except ValueError as err:
            name, _, rest = str(err).partition(": ")
            raise ValueError(f"{prefix}_{name}: {rest}" if name in _WEIGHT_ARGS else str(err)) from None


def _swiglu_reference(x, gate_codes, gate_codebooks, gate_scales, up_codes, up_codebooks, up_scales, gate_bias,
                      up_bias):
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    return vq_swiglu_reference(x, gate_codes, gate_codebooks, gate_scales, up_codes, up_codebooks, up_scales,
                               gate_bias, up_bias, compute_dtype=compute)


def _vq_swiglu_fake(x, gate_codes, gate_codebooks, gate_scales, up_codes, up_codebooks, up_scales, gate_bias,
                    up_bias):
    return x.new_empty(*x.shape[:-1], gate_codes.shape[0])


_swiglu_plans = PlanCache()


def _plan_swiglu(x, *weights) -> _SwiGLUCall:
    key = plan_key(x, *weights)
    call = _swiglu_plans.get(key) if key is not None else None
    if call is not None:
        return call
    _validate_swiglu(x, *weights)
    n, k = weights[0].shape[0], x.shape[-1]
    m = x.numel() // k if k else 0
    reference = x.dtype not in KERNEL_DTYPES or n == 0 or k == 0 or choose_backend(x.device) != "triton"
    if not reference and m:
        check_interpretable("x", x.dtype)
    # fused where the cost model predicts the fused kernel faster than two vq_matmul calls on their
    # own picks and the epilogue (configs.decide_swiglu), or under force(variant="small"); another
    # pinned variant runs the two calls
    fused = not reference and 0 < m <= SWIGLU_MAX_TOKENS and swiglu_decision(m, n, k, x.device)
    if not fused:     # the reference, no tokens, or two vq_matmul calls
        call = _SwiGLUCall()
        call.reference, call.m, call.fused = reference, m, False
    else:
        gate_bias, up_bias = weights[6], weights[7]
        call = _swiglu_call(m, n, k, x.device, gate_bias is not None, up_bias is not None, "auto", k, n)
    call.out_shape = (*x.shape[:-1], n)
    return _swiglu_plans.remember(key, call)


def _run_swiglu(call: _SwiGLUCall, x, gate_codes, gate_codebooks, gate_scales, up_codes, up_codebooks, up_scales,
                gate_bias, up_bias) -> torch.Tensor:
    weights = (gate_codes, gate_codebooks, gate_scales, up_codes, up_codebooks, up_scales, gate_bias, up_bias)
    if call.reference:
        return _swiglu_reference(x, *weights)
    if call.m == 0:     # no tokens (an MoE expert no token was routed to): an empty output, no launch
        return torch.empty(call.out_shape, dtype=x.dtype, device=x.device)
    k, n = x.shape[-1], gate_codes.shape[0]
    x2d = x.reshape(call.m, k)
    if not x2d.is_contiguous():
        x2d = x2d.contiguous()
    if not call.fused:      # where the fused kernel is not predicted faster: each projection by its dispatch
        gate = vq_matmul(x2d, gate_codes, gate_codebooks, gate_scales, gate_bias)
        up = vq_matmul(x2d, up_codes, up_codebooks, up_scales, up_bias)
        return silu_mul_outputs(gate, up).reshape(call.out_shape)
    out = torch.empty(call.out_shape, dtype=x.dtype, device=x.device)
    _launch_swiglu(call, x2d, gate_codes, gate_codebooks, gate_scales.view(n), up_codes, up_codebooks,
                   up_scales.view(n), gate_bias, up_bias, out.view(call.m, n))
    return out


@tilefuse_op("vq_swiglu", fake=_vq_swiglu_fake,
             backward=no_backward("tilefuse.vq_swiglu", "the fused 2-bit gate/up projection"))
def _vq_swiglu_op(x: torch.Tensor, gate_codes: torch.Tensor, gate_codebooks: torch.Tensor, gate_scales: torch.Tensor,
                  up_codes: torch.Tensor, up_codebooks: torch.Tensor, up_scales: torch.Tensor,
                  gate_bias: torch.Tensor | None, up_bias: torch.Tensor | None) -> torch.Tensor:
    weights = (gate_codes, gate_codebooks, gate_scales, up_codes, up_codebooks, up_scales, gate_bias, up_bias)
    return _run_swiglu(_plan_swiglu(x, *weights), x, *weights)


def explain_vq_swiglu(x: torch.Tensor, gate_codes: torch.Tensor, gate_codebooks: torch.Tensor,
                      gate_scales: torch.Tensor, up_codes: torch.Tensor, up_codebooks: torch.Tensor,
                      up_scales: torch.Tensor, gate_bias: torch.Tensor | None = None,
                      up_bias: torch.Tensor | None = None, **_) -> _dispatch.Choice:
    """The path ``vq_swiglu(...)`` runs and why (``tilefuse.explain(tilefuse.vq_swiglu, ...)``):
    ``fused`` (the one-launch kernel, its prediction the small kernel's on 2N rows) or ``unfused``
    (two calls of ``vq_matmul``'s pick, named with its prediction, and the one-pass epilogue:
    ``configs.decide_swiglu``), or the reference, or no tokens."""
    weights = (gate_codes, gate_codebooks, gate_scales, up_codes, up_codebooks, up_scales, gate_bias, up_bias)
    call = _plan_swiglu(x, *weights)         # the op's own plan: validated, forced or not
    n, k = gate_codes.shape[0], x.shape[-1]
    m = x.numel() // k if k else 0
    problem = {"M": m, "N": n, "K": k, "dtype": str(x.dtype).removeprefix("torch."), "device": str(x.device)}
    if call.reference:
        return _dispatch.Choice("vq", problem, "reference", None, "reference")
    if m == 0:
        return _dispatch.Choice("vq", problem, "empty", None, "no tokens: an empty output, no launch")
    fused_us, pick, unfused_us = configs.swiglu_predictions(m, n, k, wgmma_prefill_applies(k, x.device),
                                                            *_chip_args(x.device))
    pick_us = (unfused_us - configs.SWIGLU_EPILOGUE_US) / 2
    candidates = (
        _dispatch.Candidate("fused", None, fused_us if m <= SWIGLU_MAX_TOKENS else None,
                            "one launch: both weights, SiLU * up in the epilogue (kernels_swiglu)"),
        _dispatch.Candidate("unfused", None, unfused_us,
                            f"two vq_matmul calls ({pick.variant}, {pick_us:.1f} us each) + one SiLU * up pass"))
    source = "forced" if forced_variant("vq") else "cost model"
    return _dispatch.Choice("vq", problem, "fused" if call.fused else "unfused", None, source, candidates)


def vq_swiglu(x: torch.Tensor, gate_codes: torch.Tensor, gate_codebooks: torch.Tensor, gate_scales: torch.Tensor,
              up_codes: torch.Tensor, up_codebooks: torch.Tensor, up_scales: torch.Tensor,
              gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None, *,
              check_contents: bool | None = None) -> torch.Tensor:
    """``silu(x @ Wg^T + bg) * (x @ Wu^T + bu)`` for two 2-bit weights in AQLM's 2x8 format (a gated
    MLP's gate and up projections), in one launch at decode sizes: x is read once, the ``[M, 2N]``
    gate/up intermediate never reaches memory.

    Each weight as :func:`vq_matmul` takes it: ``W[n, 8g:8g+8] = scales[n] * (C0[codes[n, g, 0]] +
    C1[codes[n, g, 1]])``.

    Parameters
    ----------
    x : [..., K], K a multiple of 8. fp16 or bf16 run the kernels on CUDA; fp32 / fp64 run the
        PyTorch reference on every device.
    gate_codes, up_codes : [N, K/8, 2] uint8 or int8 (AQLM's), or a wider integer dtype with values
        in [0, 256); both the same N.
    gate_codebooks, up_codebooks : [2, 256, 1, 8], any floating dtype (each weight its own).
    gate_scales, up_scales : [N, 1, 1, 1] (or [N]) floating point.
    gate_bias, up_bias : [N] floating point or None (each independently).
    check_contents : read wide codes back to check their range (a host sync); default ``TILEFUSE_DEBUG``.

    Returns
    -------
    [..., N] in x's dtype. Where the cost model predicts it faster (``configs.decide_swiglu``:
    MoE-expert and small-model sizes, N and K multiples of 128, up to 128 tokens) one kernel
    (``kernels_swiglu.py``: a program owns 16 rows of both weights and all of K, split over its
    warps and summed in shared memory in a fixed order; no workspace, no atomics): each weight
    ``C0[a] + C1[b]`` rounded once to x's dtype, fp32 sums, the row scales and biases, then SiLU
    times up in fp32 and one rounding. Elsewhere: each projection by :func:`vq_matmul` (rounded to
    x's dtype), then SiLU times up in fp32 in one pass
    (``kernels_swiglu.vq_swiglu_epilogue_kernel``: one launch where ``silu(g) * up`` takes two). No tokens:
    an empty ``[..., N]``, no launch. No gradient (call it under ``torch.no_grad()``).
    """
    weights = [gate_codes, gate_codebooks, gate_scales, up_codes, up_codebooks, up_scales, gate_bias, up_bias]
    if not all(isinstance(t, torch.Tensor) for t in (x, *weights[:6], *(b for b in weights[6:] if b is not None))):
        _validate_swiglu(x, *weights)       # raises, naming the argument
    for i in (0, 3):
        if weights[i].dtype in WIDE_CODE_DTYPES:
            _validate_swiglu(x, *weights)
            checks = _env.settings.debug if check_contents is None else check_contents
            if checks and not _checks.contents_unreadable(weights[i]):
                try:
                    check_code_range(weights[i])
                except ValueError as err:
                    raise ValueError(f"{('gate', '', '', 'up')[i]}_{err}") from None
            weights[i] = weights[i].to(torch.uint8)
    if torch.compiler.is_compiling():
        # traced: metadata checks and the custom op only; the op plans on concrete sizes when it runs
        _validate_swiglu(x, *weights)
        return _vq_swiglu_op(x, *(t if t is None else t.contiguous() for t in weights))
    # the kernels read codes, codebooks, scales and biases as dense arrays (no copy when they are)
    weights = [t if t is None or t.is_contiguous() else t.contiguous() for t in weights]
    call = _plan_swiglu(x, *weights)
    if use_dispatcher(x, *weights):
        return _vq_swiglu_op(x, *weights)
    return _run_swiglu(call, x, *weights)


# ----------------------------------------------------------------------------- MoE experts
from tilefuse.ops.vq.reference import vq_moe_reference  # noqa: E402

MOE_INDEX_DTYPES = (torch.int32, torch.int64)
MOE_SUM_BLOCK = 1024        # columns per program of the top-k sum
_MOE_WEIGHTS = ("gate_up_codes", "gate_up_codebooks", "gate_up_scales", "down_codes", "down_codebooks", "down_scales")


def _moe_kernel(name: str, impl: str):
    """``kernels_moe.<name>`` (Gluon) or its ``tl`` twin ``<name>`` with ``_tl`` before ``_kernel``."""
    return _kernel("kernels_moe", name if impl == "gluon" else name.replace("_kernel", "_tl_kernel"))


class _MoECall:
    """A ``vq_moe`` call's plan per argument layout: the reference or not, tokens, top-k, experts,
    sizes, per-pair or grouped programs (``grouped``: tiles of one expert's tokens, ``tiles`` of
    ``tokens`` each at most), both kernels' launch settings (``configs.moe_config``) and, grouped,
    the schedule kernel's (``configs.moe_schedule_meta``; None: the PyTorch schedule)."""

    __slots__ = ("reference", "t", "k", "e", "h", "i", "impl", "gate_up", "down", "sum_grid", "grouped", "tiles",
                 "tokens", "schedule", "dequant")


def _moe_launch(cfg: dict, scalars: tuple, grouped: bool) -> tuple:
    """(grid, scalars, constexprs) of one MoE kernel launch from its ``moe_config``."""
    meta = dict(TOKENS=cfg["tokens"], KREP=cfg["krep"], ROW_TILES=cfg["row_tiles"], SLICES=cfg["slices"],
                COPIES=cfg["copies"], EVEN=cfg["even"], GROUPED=grouped, num_warps=cfg["num_warps"])
    return cfg["grid"], scalars, meta


def moe_tiles(pairs: int, num_experts: int, tokens: int) -> int:
    """Grouped programs' tiles for ``pairs`` token-expert pairs: every expert's pairs in tiles of
    ``tokens``, at most ``pairs // tokens`` full tiles plus one partial tile per expert hit."""
    return pairs // tokens + min(num_experts, pairs)


def _grouped_mm_syncs(dtype: torch.dtype, device: torch.device) -> bool:
    """PyTorch's grouped GEMM (the MoE dequantize path's) on a GPU takes its fused kernel for
    bf16 only; with fp16 it loops over the groups with their offsets read on the host (a sync,
    which a CUDA graph refuses to capture)."""
    return device.type == "cuda" and dtype != torch.bfloat16


def _moe_plan(t: int, k: int, e: int, h: int, i: int, device: torch.device, impl: str = "auto",
              gate_up: dict | None = None, down: dict | None = None, grouped: bool | None = None,
              dequant: bool | None = None, dtype: torch.dtype = torch.bfloat16) -> _MoECall:
    """The launches of the three MoE kernels for ``t`` tokens of top-``k`` routing over ``e``
    experts of ``[2I, H]`` gate/up and ``[H, I]`` down weights. ``gate_up``, ``down``: overrides
    of ``configs.moe_config`` (tuning and tests); ``grouped``: tiles of one expert's tokens (None:
    from ``configs.MOE["group_pairs"]`` pairs on, else a program per pair); ``dequant``: the
    dequantize + grouped GEMM path instead (None: from ``configs.MOE["dequant_pairs"]`` pairs on
    where that is set, 0: never; on a GPU for a bf16 ``dtype`` only: :func:`_grouped_mm_syncs`)."""
    impl = _gluon_or_tl(impl, device, _moe_kernel("vq_moe_gate_up_kernel", "gluon"), "MoE expert kernels")
    on_gpu, sms, pairs = impl == "gluon", num_sms(device), t * k
    call = _MoECall()
    call.reference, call.t, call.k, call.e, call.h, call.i, call.impl = False, t, k, e, h, i, impl
    threshold = configs.MOE["dequant_pairs"]
    call.dequant = (bool(threshold) and pairs >= threshold and not _grouped_mm_syncs(dtype, device)
                    if dequant is None else bool(dequant))
    call.grouped = pairs >= configs.MOE["group_pairs"] if grouped is None else bool(grouped)
    gate_up, down = dict(gate_up or {}), dict(down or {})
    if not call.grouped:      # one token per program
        gate_up["tokens"] = down["tokens"] = 1
    call.tokens = configs.moe_config(1, i, h, on_gpu, sms, **gate_up)["tokens"]
    down["tokens"] = down.get("tokens") or call.tokens          # one schedule for both kernels
    call.tiles = moe_tiles(pairs, e, call.tokens) if call.grouped else pairs
    cfg = configs.moe_config(call.tiles, i, h, on_gpu, sms, **gate_up)
    call.gate_up = _moe_launch(cfg, (e, k, i, h // 8, cfg["groups_per_slice"], h, 2 * i * (h // 8), h // 8, i,
                                     call.tiles), call.grouped)
    cfg = configs.moe_config(call.tiles, h, i, on_gpu, sms, **down)
    call.down = _moe_launch(cfg, (e, k, h, i // 8, cfg["groups_per_slice"], i, h * (i // 8), i // 8, h, call.tiles),
                            call.grouped)
    call.sum_grid = (t, -(-h // MOE_SUM_BLOCK), 1)
    call.schedule = configs.moe_schedule_meta(pairs, e) if call.grouped else None
    return call


def moe_schedule(top_k_index: torch.Tensor, num_experts: int, tokens: int, num_tiles: int):
    """The grouped programs' schedule, computed on the device (no host sync: graph-capturable).

    Pairs ``p = t * k + j`` sorted by expert id (stable: token order within an expert; ids outside
    ``[0, E)`` last, in no tile); each expert's pairs cut into tiles of ``tokens``. Returns
    ``(schedule, tokens_sorted, pairs_sorted)``: int32 ``[3 * num_tiles]`` (each tile's expert, E
    for the empty tiles past the last; its first position in the sorted order; its pair count, 0
    for the empty ones), and the sorted pairs' tokens and indices, int32 ``[P]``."""
    k = top_k_index.shape[1]
    ids = top_k_index.reshape(-1)
    device = ids.device
    key = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts).to(torch.int64)
    order = torch.sort(key, stable=True).indices
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).index_add_(0, key, torch.ones_like(key))
    tiles = (counts[:num_experts] + tokens - 1) // tokens
    tile_end = tiles.cumsum(0)
    start = counts.cumsum(0) - counts
    tau = torch.arange(num_tiles, device=device)
    expert = torch.searchsorted(tile_end, tau, right=True)         # E for the tiles past the last
    clamped = expert.clamp(max=num_experts - 1)
    first = start[clamped] + (tau - (tile_end - tiles)[clamped]) * tokens
    count = torch.where(expert < num_experts, (start[clamped] + counts[clamped] - first).clamp(0, tokens), 0)
    schedule = torch.cat([expert, first.clamp(0, ids.numel()), count]).to(torch.int32)
    return schedule, (order // k).to(torch.int32), order.to(torch.int32)


def moe_schedule_launch(top_k_index: torch.Tensor, num_experts: int, tokens: int, num_tiles: int, meta: dict,
                        key=None):
    """:func:`moe_schedule`'s three outputs, bit-identical, from one launch of
    ``kernels_moe.vq_moe_schedule_kernel`` (one program; ``meta``: ``configs.moe_schedule_meta``)
    into one int32 buffer. top_k_index: [T, k] contiguous, int32 or int64; ``key``: the launch's
    plan key (None: built from the sizes)."""
    pairs = top_k_index.numel()
    sorted_at = -(-3 * num_tiles // 4) * 4              # each output 16-byte aligned in the buffer
    pairs_at = sorted_at + -(-pairs // 4) * 4
    buf = torch.empty(pairs_at + pairs, dtype=torch.int32, device=top_k_index.device)
    schedule, tok_sorted, pair_sorted = buf[:3 * num_tiles], buf[sorted_at:sorted_at + pairs], buf[pairs_at:]
    if key is None:
        key = (pairs, top_k_index.shape[1], num_experts, tokens, num_tiles, tuple(meta.items()))
    _kernel("kernels_moe", "vq_moe_schedule_kernel").launch(
        (key, top_k_index.dtype, top_k_index.data_ptr() % 16, buf.data_ptr() % 16), (1, 1, 1),
        top_k_index.device.index, (top_k_index, schedule, tok_sorted, pair_sorted),
        (pairs, num_experts, top_k_index.shape[1], tokens, num_tiles), meta)
    return schedule, tok_sorted, pair_sorted


def _moe_sum(call: _MoECall, y_buf, top_k_index, out) -> torch.Tensor:
    """``out[t] = sum_j y_buf[t * k + j]`` over the in-range pairs, in slot order
    (``vq_moe_sum_kernel``): the last launch of both MoE paths."""
    _kernel("kernels_moe", "vq_moe_sum_kernel").launch(
        (call, "sum", top_k_index.data_ptr() % 16, out.data_ptr() % 16), call.sum_grid, out.device.index,
        (y_buf, top_k_index, out), (call.e, call.h), dict(TOPK=call.k, BLOCK=MOE_SUM_BLOCK, num_warps=4))
    return out


def launch_moe_dequant(call: _MoECall, x, top_k_index, top_k_weights, gate_up_codes, gate_up_codebooks,
                       gate_up_scales, down_codes, down_codebooks, down_scales, out) -> torch.Tensor:
    """The dequantize path (prefill sizes, ``call.dequant``), the MoE analogue of ``vq_matmul``'s
    dequantize + cuBLAS: every expert's gate/up and down weight dequantized into scratch
    ``[E, 2I, H]`` and ``[E, H, I]`` in x's dtype (``vq_moe_dequant_kernel``, one launch each), the
    pairs sorted by expert on the device (ids outside ``[0, E)`` last, in no group), PyTorch's
    grouped GEMM over the sorted rows for gate/up, ``silu(g) * u`` in fp32 rounded to x's dtype
    (as the kernels' h), the grouped GEMM for down, times the routing weight into ``y_p`` (fp32,
    by pair), then the slot sum (``vq_moe_sum_kernel``, which reads only in-range pairs). No host
    sync. Scratch: ``E * 3 * I * H`` elements of x's dtype, freed after the call."""
    (t, h), k, e, i = x.shape, call.k, call.e, call.i
    device = x.device
    w_gate_up = torch.empty(e, 2 * i, h, dtype=x.dtype, device=device)
    w_down = torch.empty(e, h, i, dtype=x.dtype, device=device)
    meta = dict(BLOCK_N=DEQUANT_LAUNCH["BLOCK_N"], BLOCK_G=DEQUANT_LAUNCH["BLOCK_G"],
                num_warps=DEQUANT_LAUNCH["num_warps"])
    for codes, books, scales, w in ((gate_up_codes, gate_up_codebooks, gate_up_scales, w_gate_up),
                                    (down_codes, down_codebooks, down_scales, w_down)):
        n, kk = w.shape[1], w.shape[2]
        codes8 = codes if codes.dtype == torch.uint8 else codes.view(torch.uint8)   # int8 codes: the same bits
        grid = (*_dequant_grid(n, kk, meta)[:2], e)
        _kernel("kernels_moe", "vq_moe_dequant_kernel").launch(
            ("moe dequant", x.dtype, n, kk, e, *(a.data_ptr() % 16 for a in (codes8, books, scales, w))), grid,
            device.index, (codes8, books, scales, w), (n, kk // 8, kk // 4, kk, n * (kk // 4), n * kk), meta)
    ids = top_k_index.reshape(-1)
    key = torch.where((ids >= 0) & (ids < e), ids, e)
    order = torch.sort(key, stable=True).indices
    counts = torch.zeros(e + 1, dtype=torch.int64, device=device).index_add_(0, key, torch.ones_like(key))
    offs = counts[:e].cumsum(0).to(torch.int32)                       # rows past offs[-1]: no group
    gate_up = torch._grouped_mm(x.index_select(0, order // k), w_gate_up.transpose(1, 2), offs=offs)
    h_sorted = (torch.nn.functional.silu(gate_up[:, :i].float()) * gate_up[:, i:].float()).to(x.dtype)
    y_sorted = torch._grouped_mm(h_sorted, w_down.transpose(1, 2), offs=offs)
    y_buf = torch.empty(t * k, h, dtype=torch.float32, device=device)
    y_buf[order] = y_sorted.float() * top_k_weights.reshape(-1)[order, None].float()
    return _moe_sum(call, y_buf, top_k_index, out)


def launch_moe(call: _MoECall, x, top_k_index, top_k_weights, gate_up_codes, gate_up_codebooks, gate_up_scales,
               down_codes, down_codebooks, down_scales, out) -> torch.Tensor:
    """The MoE launches into ``out`` [T, H] (any contents): grouped calls first compute their
    schedule (one launch, :func:`moe_schedule_launch`; :func:`moe_schedule`'s PyTorch ops where
    ``call.schedule`` is None). x: [T, H] contiguous; top_k_index,
    top_k_weights: [T, k] contiguous; weights contiguous, scales of any shape with E x rows values."""
    pairs = call.t * call.k
    device = x.device
    h_buf = torch.empty(pairs, call.i, dtype=x.dtype, device=device)          # silu(g) * u per pair
    y_buf = torch.empty(pairs, call.h, dtype=torch.float32, device=device)    # w * down(h) per pair
    if call.grouped and call.schedule is not None:
        sched, tok_sorted, pair_sorted = moe_schedule_launch(top_k_index, call.e, call.tokens, call.tiles,
                                                             call.schedule, call)
    elif call.grouped:
        sched, tok_sorted, pair_sorted = moe_schedule(top_k_index, call.e, call.tokens, call.tiles)
    else:
        sched = tok_sorted = pair_sorted = top_k_index      # unread
    tensors = (x, top_k_index, _code_pairs(gate_up_codes), gate_up_codebooks, gate_up_scales, h_buf, sched,
               tok_sorted, pair_sorted)
    grid, scalars, meta = call.gate_up
    _moe_kernel("vq_moe_gate_up_kernel", call.impl).launch(
        (call, "gate_up", *(t.data_ptr() % 16 for t in tensors)), grid, device.index, tensors, scalars, meta)
    tensors = (h_buf, top_k_index, top_k_weights, _code_pairs(down_codes), down_codebooks, down_scales, y_buf,
               sched, pair_sorted)
    grid, scalars, meta = call.down
    _moe_kernel("vq_moe_down_kernel", call.impl).launch(
        (call, "down", *(t.data_ptr() % 16 for t in tensors)), grid, device.index, tensors, scalars, meta)
    return _moe_sum(call, y_buf, top_k_index, out)


def _validate_moe(x, top_k_index, top_k_weights, gate_up_codes, gate_up_codebooks, gate_up_scales, down_codes,
                  down_codebooks, down_scales) -> None:
    """Shapes, dtypes and devices (metadata only: the expert ids are not read)."""
    _checks.check_tensor("x", x, dtypes=_checks.FLOATS, ndim=2)
    t, h = x.shape
    _checks.check_multiple("x", h, 8, "H (last dimension)")
    _checks.check_tensor("top_k_index", top_k_index, dtypes=MOE_INDEX_DTYPES, ndim=2)
    k = top_k_index.shape[1]
    _checks.check_shape("top_k_index", top_k_index, (t, k), "[T, k] (T: x's rows)")
    _checks.check_tensor("top_k_weights", top_k_weights, dtypes=_checks.FLOATS, ndim=2)
    _checks.check_shape("top_k_weights", top_k_weights, (t, k), "[T, k] (top_k_index's shape)")
    _checks.check_tensor("gate_up_codes", gate_up_codes, dtypes=CODE_DTYPES, ndim=4)
    e, rows = gate_up_codes.shape[:2]
    if rows % 2 or (rows // 2) % 8:
        raise ValueError(f"gate_up_codes: expected [E, 2I, H/8, 2] with I a multiple of 8 (gate rows, then up "
                         f"rows), got shape {tuple(gate_up_codes.shape)}")
    i = rows // 2
    _checks.check_shape("gate_up_codes", gate_up_codes, (e, 2 * i, h // 8, 2), f"[E, 2I, H/8={h // 8}, 2]")
    _checks.check_tensor("gate_up_codebooks", gate_up_codebooks, dtypes=_checks.FLOATS, ndim=5)
    _checks.check_shape("gate_up_codebooks", gate_up_codebooks, (e, 2, 256, 1, 8), f"[E={e}, 2, 256, 1, 8]")
    _checks.check_tensor("down_codes", down_codes, dtypes=CODE_DTYPES, ndim=4)
    _checks.check_shape("down_codes", down_codes, (e, h, i // 8, 2), f"[E={e}, H={h}, I/8={i // 8}, 2]")
    _checks.check_tensor("down_codebooks", down_codebooks, dtypes=_checks.FLOATS, ndim=5)
    _checks.check_shape("down_codebooks", down_codebooks, (e, 2, 256, 1, 8), f"[E={e}, 2, 256, 1, 8]")
    for name, scales, n in (("gate_up_scales", gate_up_scales, 2 * i), ("down_scales", down_scales, h)):
        _checks.check_tensor(name, scales, dtypes=_checks.FLOATS, min_ndim=2)
        if scales.numel() != e * n or tuple(scales.shape[:2]) != (e, n):
            raise ValueError(f"{name}: expected a floating tensor of shape [E={e}, {n}] or [E={e}, {n}, 1, 1, 1], "
                             f"got {scales.dtype} {tuple(scales.shape)}")
    _checks.check_same_device(x=x, top_k_index=top_k_index, top_k_weights=top_k_weights, gate_up_codes=gate_up_codes,
                              gate_up_codebooks=gate_up_codebooks, gate_up_scales=gate_up_scales,
                              down_codes=down_codes, down_codebooks=down_codebooks, down_scales=down_scales)


def check_expert_ids(top_k_index: torch.Tensor, num_experts: int) -> None:
    """Every expert id in ``[0, num_experts)``: reads the ids (a host sync)."""
    if top_k_index.numel():
        lo, hi = (int(v) for v in torch.aminmax(top_k_index))
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"top_k_index: expected expert ids in [0, {num_experts}), got [{lo}, {hi}] (ids out of "
                             f"range contribute nothing without check_contents)")


def _moe_reference(x, *args):
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    return vq_moe_reference(x, *args, compute_dtype=compute)


def _vq_moe_fake(x, top_k_index, top_k_weights, gate_up_codes, gate_up_codebooks, gate_up_scales, down_codes,
                 down_codebooks, down_scales):
    return x.new_empty(x.shape[0], x.shape[1])


_moe_plans = PlanCache()


def _plan_moe(x, *args) -> _MoECall:
    key = plan_key(x, *args)
    call = _moe_plans.get(key) if key is not None else None
    if call is not None:
        return call
    _validate_moe(x, *args)
    (t, h), k = x.shape, args[0].shape[1]
    e, i = args[2].shape[0], args[2].shape[1] // 2
    reference = x.dtype not in KERNEL_DTYPES or choose_backend(x.device) != "triton"
    if not reference and t * k and e and i:
        check_interpretable("x", x.dtype)
        call = _moe_plan(t, k, e, h, i, x.device, dtype=x.dtype)
    else:
        call = _MoECall()
        call.t, call.k, call.e, call.h, call.i = t, k, e, h, i
        call.grouped, call.tiles, call.tokens, call.gate_up, call.down, call.schedule = False, 0, 0, None, None, None
    call.reference = reference
    return _moe_plans.remember(key, call)


def _run_moe(call: _MoECall, x, top_k_index, top_k_weights, *weights) -> torch.Tensor:
    if call.reference:
        return _moe_reference(x, top_k_index, top_k_weights, *weights)
    if call.t * call.k == 0 or call.e == 0 or call.i == 0:     # no pairs, experts or rows: nothing routed
        return torch.zeros(call.t, call.h, dtype=x.dtype, device=x.device)
    out = torch.empty(call.t, call.h, dtype=x.dtype, device=x.device)
    if call.dequant:
        return launch_moe_dequant(call, x, top_k_index, top_k_weights, *weights, out)
    return launch_moe(call, x, top_k_index, top_k_weights, *weights, out)


@tilefuse_op("vq_moe", fake=_vq_moe_fake, backward=no_backward("tilefuse.vq_moe", "the 2-bit MoE experts"))
def _vq_moe_op(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up_codes: torch.Tensor,
               gate_up_codebooks: torch.Tensor, gate_up_scales: torch.Tensor, down_codes: torch.Tensor,
               down_codebooks: torch.Tensor, down_scales: torch.Tensor) -> torch.Tensor:
    args = (top_k_index, top_k_weights, gate_up_codes, gate_up_codebooks, gate_up_scales, down_codes, down_codebooks,
            down_scales)
    return _run_moe(_plan_moe(x, *args), x, *args)


def explain_vq_moe(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   gate_up_codes: torch.Tensor, gate_up_codebooks: torch.Tensor, gate_up_scales: torch.Tensor,
                   down_codes: torch.Tensor, down_codebooks: torch.Tensor, down_scales: torch.Tensor,
                   **_) -> _dispatch.Choice:
    """The path ``vq_moe(...)`` runs and why (``tilefuse.explain(tilefuse.vq_moe, ...)``):
    ``per_pair`` (a program per token-expert pair and row block), ``grouped`` (tiles of up to
    ``tokens`` pairs of one expert, their schedule computed on the device) or ``dequant`` (every
    expert dequantized, then PyTorch's grouped GEMM), by the rules ``configs.MOE["group_pairs"]``
    and ``["dequant_pairs"]`` (no cost model yet), with the forms' launch grids; or the reference,
    or nothing routed."""
    args = (top_k_index, top_k_weights, gate_up_codes, gate_up_codebooks, gate_up_scales, down_codes,
            down_codebooks, down_scales)
    call = _plan_moe(x, *args)              # the op's own plan: validated
    problem = {"T": call.t, "k": call.k, "E": call.e, "H": call.h, "I": call.i,
               "dtype": str(x.dtype).removeprefix("torch."), "device": str(x.device)}
    if call.reference:
        return _dispatch.Choice("vq", problem, "reference", None, "reference")
    if call.t * call.k == 0 or call.e == 0 or call.i == 0:
        return _dispatch.Choice("vq", problem, "empty", None, "nothing routed: zeros, no launch")
    pairs, threshold = call.t * call.k, configs.MOE["group_pairs"]
    schedule = ("one launch (vq_moe_schedule_kernel)" if configs.MOE.get("schedule_kernel") and call.e < 1024
                else "PyTorch's sort, cumsum and searchsorted")
    dequant_from = configs.MOE["dequant_pairs"]
    candidates = (
        _dispatch.Candidate("per_pair", None, None, f"a program per pair: {pairs} x {call.gate_up[0][1]} gate/up "
                                                    f"and {pairs} x {call.down[0][1]} down programs; below "
                                                    f"{threshold} pairs"),
        _dispatch.Candidate("grouped", None, None, f"tiles of up to {call.tokens} pairs of one expert "
                                                   f"(at most {moe_tiles(pairs, call.e, call.tokens)}), schedule: "
                                                   f"{schedule}; from {threshold} pairs"),
        _dispatch.Candidate("dequant", None, None, "every expert dequantized into a scratch weight, then PyTorch's "
                                                   "grouped GEMM; " + (f"from {dequant_from} pairs" if dequant_from
                                                                      else "off (configs.MOE dequant_pairs = 0)")))
    variant = "dequant" if call.dequant else "grouped" if call.grouped else "per_pair"
    return _dispatch.Choice("vq", problem, variant, call.tokens,
                            f"measured rule (group_pairs = {threshold}, dequant_pairs = {dequant_from})", candidates)


def vq_moe(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up_codes: torch.Tensor,
           gate_up_codebooks: torch.Tensor, gate_up_scales: torch.Tensor, down_codes: torch.Tensor,
           down_codebooks: torch.Tensor, down_scales: torch.Tensor, *,
           check_contents: bool | None = None) -> torch.Tensor:
    """An MoE block's routed experts with 2-bit weights in AQLM's 2x8 format, routing read on the
    device (no host sync: a CUDA graph replays any routing; ``torch.compile(fullgraph=True)``
    traces it): the arguments and result of transformers' ``Qwen3MoeExperts.forward`` (Qwen3-MoE,
    Qwen2-MoE, OLMoE, Mixtral-style experts: SiLU-gated, gate and up stacked in one weight).

    ``y[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))``, ``e = top_k_index[t, j]``;
    each expert's weights as :func:`vq_matmul` takes one layer's:
    ``W[n, 8g:8g+8] = scales[n] * (C0[codes[n, g, 0]] + C1[codes[n, g, 1]])``.

    Parameters
    ----------
    x : [T, H], H a multiple of 8. fp16 or bf16 run the kernels on CUDA (and in Triton's
        interpreter: fp16); fp32 / fp64 run the PyTorch reference.
    top_k_index : [T, k] int32 or int64 expert ids. An id outside ``[0, E)`` (transformers'
        expert-parallel sentinel is E) makes its slot contribute nothing; it is not an error unless
        ``check_contents`` (the ids are only read on the device otherwise).
    top_k_weights : [T, k] floating point routing weights (applied in fp32).
    gate_up_codes : [E, 2I, H/8, 2] uint8 or int8 (AQLM's): per expert the gate's I rows, then
        the up's I rows (transformers' ``gate_up_proj [E, 2I, H]`` layout); I a multiple of 8.
    gate_up_codebooks : [E, 2, 256, 1, 8] floating point: one codebook pair per expert, shared by
        its gate and up rows.
    gate_up_scales : [E, 2I] (or [E, 2I, 1, 1, 1]) floating point.
    down_codes : [E, H, I/8, 2] uint8 or int8; down_codebooks : [E, 2, 256, 1, 8];
    down_scales : [E, H] (or [E, H, 1, 1, 1]).
    check_contents : read the expert ids back and raise ValueError for ids outside ``[0, E)`` (a
        host sync); default ``TILEFUSE_DEBUG``. Skipped while ``torch.compile`` traces.

    Returns
    -------
    [T, H] in x's dtype. Three launches (``kernels_moe.py``; from ``configs.MOE["group_pairs"]``
    pairs on, a schedule launch first): the fused gate/up and SiLU·mul per (token-expert pair,
    16-row block) into ``h [T*k, I]`` (x's dtype), the down projection times
    the routing weight per pair into fp32 ``[T*k, H]``, and the sum over the k slots in slot order,
    one rounding. No atomics: repeated calls give the same bits. Only the selected experts' codes
    are read. No tokens: ``[0, H]``. No gradient (call it under ``torch.no_grad()``).
    """
    args = [top_k_index, top_k_weights, gate_up_codes, gate_up_codebooks, gate_up_scales, down_codes,
            down_codebooks, down_scales]
    if not all(isinstance(a, torch.Tensor) for a in (x, *args)):
        _validate_moe(x, *args)             # raises, naming the argument
    checks = _env.settings.debug if check_contents is None else check_contents
    if checks and not torch.compiler.is_compiling() and not _checks.contents_unreadable(top_k_index):
        _validate_moe(x, *args)
        check_expert_ids(top_k_index, gate_up_codes.shape[0])
    # the kernels read every argument as a dense array (no copy when they are)
    x = x if x.is_contiguous() else x.contiguous()
    args = [a if a.is_contiguous() else a.contiguous() for a in args]
    if torch.compiler.is_compiling():
        # traced: metadata checks and the custom op only; the op plans on concrete sizes when it runs
        _validate_moe(x, *args)
        return _vq_moe_op(x, *args)
    call = _plan_moe(x, *args)
    if use_dispatcher(x, *args):
        return _vq_moe_op(x, *args)
    return _run_moe(call, x, *args)
