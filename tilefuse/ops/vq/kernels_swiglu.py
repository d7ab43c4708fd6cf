"""One-launch 2-bit gate/up projection with the SwiGLU epilogue: ``h = silu(x Wg^T + bg) * (x Wu^T + bu)``.

``Wg`` and ``Wu`` are two AQLM 2x8 weights (each its own codes, codebooks and row scales):
``W[n, 8g:8g+8] = scale[n] * (C0[c0(n, g)] + C1[c1(n, g)])``. The kernel is the small-layer kernel
(``kernels_small.py``) run on both weights at once: a program owns ``ROWS = 16 * ROW_TILES`` rows
of *both* projections and the whole of K, K split over its warps, the warps' partial sums meeting
in shared memory in a fixed order (no workspace, no atomics, bit-identical repeats). Each step
reads its slice of x once and feeds it to two MMAs (gate and up); the ``[M, 2N]`` gate/up
intermediate never leaves the program: the epilogue computes ``silu(g) * u`` in fp32 on the
summed accumulators and writes ``[M, N]`` once.

Stages (what moves where, and why):

* Stage 0 (HBM/L2 -> SMEM, once per program): the four codebooks (gate C0, C1, then up C0, C1) in
  x's dtype, ``COPIES`` copies of each entry, in one buffer ``[4 * 256, COPIES, 8]`` at
  ``global_smem`` + 0: the lookups' PTX (``kernels_small._dequant_ptx``) addresses codebook 1
  ``256 * COPIES * 16`` bytes after codebook 0, so the up weight's lookups are the gate's with a
  constant ``512 * COPIES * 16`` bytes added to both offsets. Each weight has its own power-of-two
  factor ``f`` (``kernels_mma.codebook_factor``; its peak scan shares the copies' barrier).
* Stage 1 (HBM -> registers): the code pairs of the gate's and the up's 16-row tiles x ``4 * KREP``
  groups of the warp's K slice, one step ahead of use (``kernels_mma._codes_layout``).
* Stage 2 (SMEM -> registers): per weight, two ``ld.shared.v4`` and four packed adds per group
  (inline PTX), the weight tile straight in ``mma.sync``'s A-operand layout.
* Stage 3 (L1/L2 -> registers -> tensor cores): the warp's slice of x^T ``[32 KREP, TOKENS]``,
  loaded once per step, and two ``mma.sync`` m16n8k16 into the gate's and the up's fp32
  accumulators. The warp's K offset comes from ``%tid`` by inline PTX (``kernels_small``).
* Stage 4 (registers -> SMEM -> registers -> HBM): both accumulators into one shared buffer
  ``[2 * SLICES * ROWS, TOKENS]`` fp32, one barrier, every slice added in slice order, the row
  scales times ``1 / f``, the biases, then ``silu(g) * u`` in fp32, one rounding, one store.

:func:`vq_swiglu_tl_kernel` is the same decomposition in ``tl`` (codebook rows gathered through L1,
one slice after the other): the twin the CPU interpreter runs.
"""

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from tilefuse.ops.gluon_compat import thread_barrier
from tilefuse.ops.vq.kernels_mma import _codes_layout, _tile_layout, codebook_factor, codebook_peaks, codebook_scan
from tilefuse.ops.vq.kernels_small import (_copies_layout, _epilogue_layout, _step_operands, _tl_projection,
                                           _weight_tile)


@gluon.jit
def _stage_codebooks(cb_ptr, cb_smem, maxima, dtype: gl.constexpr, COPIES: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Stage 0 for one weight: its two codebooks, ``COPIES`` copies of each entry, into ``cb_smem``
    (``[512, COPIES, 8]``, x's dtype), and its warps' peak magnitudes into ``maxima``."""
    CB: gl.constexpr = _copies_layout(COPIES, NUM_WARPS)
    scan = codebook_scan(cb_ptr, NUM_WARPS)
    ce = gl.arange(0, 512, layout=gl.SliceLayout(1, gl.SliceLayout(2, CB)))[:, None, None]
    cj = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, CB)))[None, None, :]
    cc = gl.arange(0, COPIES, layout=gl.SliceLayout(0, gl.SliceLayout(2, CB)))[None, :, None]
    cb_smem.store(gl.load(cb_ptr + ce * 8 + cj + cc * 0).to(dtype))
    codebook_peaks(scan, maxima)


@gluon.jit
def _rescale_codebooks(cb_ptr, cb_smem, factor, dtype: gl.constexpr, COPIES: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Rare (``f != 1``): the weight's copies stored again times ``f`` (exact: a power of two)."""
    CB: gl.constexpr = _copies_layout(COPIES, NUM_WARPS)
    ce = gl.arange(0, 512, layout=gl.SliceLayout(1, gl.SliceLayout(2, CB)))[:, None, None]
    cj = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, CB)))[None, None, :]
    cc = gl.arange(0, COPIES, layout=gl.SliceLayout(0, gl.SliceLayout(2, CB)))[None, :, None]
    entries = gl.load(cb_ptr + ce * 8 + cj + cc * 0)
    cb_smem.store((entries * factor.to(entries.dtype)).to(dtype))


@gluon.jit
def _swiglu_finish(g, u, rows, toks, M, N, g_scales_ptr, g_bias_ptr, u_scales_ptr, u_bias_ptr, out_ptr, stride_om,
                   g_inverse, u_inverse, GATE_BIAS: gl.constexpr, UP_BIAS: gl.constexpr):
    """``g``, ``u`` ([ROWS, TOKENS] fp32 sums over K) times their row scales and ``1 / f``, plus the
    biases, then ``silu(g) * u`` in fp32 into ``out[toks, rows]`` (one rounding; rows past N and
    tokens past M are not written)."""
    g = g * (gl.load(g_scales_ptr + rows, mask=rows < N, other=0.0).to(gl.float32) * g_inverse)[:, None]
    u = u * (gl.load(u_scales_ptr + rows, mask=rows < N, other=0.0).to(gl.float32) * u_inverse)[:, None]
    if GATE_BIAS:
        g += gl.load(g_bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)[:, None]
    if UP_BIAS:
        u += gl.load(u_bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)[:, None]
    h = g / (1.0 + gl.exp(-g)) * u
    ok = (rows[:, None] < N) & (toks[None, :] < M)
    gl.store(out_ptr + toks[None, :] * stride_om + rows[:, None], h.to(out_ptr.dtype.element_ty), mask=ok)


@gluon.jit
def _swiglu_finish_rows(g, u, rows, toks, M, N, g_scales_ptr, u_scales_ptr, out_ptr, stride_om, g_inverse, u_inverse,
                        out_rows_ptr):
    """:func:`_swiglu_finish` for gathered tokens (no biases): token j < M of the program goes to
    ``out[out_rows[j], rows]``."""
    g = g * (gl.load(g_scales_ptr + rows, mask=rows < N, other=0.0).to(gl.float32) * g_inverse)[:, None]
    u = u * (gl.load(u_scales_ptr + rows, mask=rows < N, other=0.0).to(gl.float32) * u_inverse)[:, None]
    h = g / (1.0 + gl.exp(-g)) * u
    ok_t = toks < M
    out_row = gl.load(out_rows_ptr + toks, mask=ok_t, other=0)
    ok = (rows[:, None] < N) & ok_t[None, :]
    gl.store(out_ptr + out_row[None, :] * stride_om + rows[:, None], h.to(out_ptr.dtype.element_ty), mask=ok)


@gluon.jit
def swiglu_program(x_ptr, g_codes_ptr, g_cb_ptr, g_scales_ptr, g_bias_ptr, u_codes_ptr, u_cb_ptr, u_scales_ptr,
                   u_bias_ptr, out_ptr, pid, m0, M, N, NUM_GROUPS, GROUPS_PER_SLICE, stride_xm, stride_cn, stride_om,
                   TOKENS: gl.constexpr, KREP: gl.constexpr, ROW_TILES: gl.constexpr, SLICES: gl.constexpr,
                   COPIES: gl.constexpr, GATE_BIAS: gl.constexpr, UP_BIAS: gl.constexpr, EVEN: gl.constexpr,
                   SHARED_BOOKS: gl.constexpr, x_rows_ptr=None, out_rows_ptr=None, GATHER: gl.constexpr = False):
    """One program of the fused gate/up kernel: rows ``pid * ROWS ...`` of both projections for
    tokens ``m0 ... m0 + TOKENS`` (those below M), every stage below, ``silu(g) * u`` into
    ``out[toks, rows]``. The weights' pointers may be offset by the caller (``kernels_moe``: an
    expert's gate and up rows of one stacked weight). ``SHARED_BOOKS``: gate and up use one
    codebook pair (``g_cb_ptr``; ``u_cb_ptr`` unused), staged once, one factor ``f``. ``GATHER``
    (an MoE expert's tokens, no biases): token j < M is x's row ``x_rows[j]`` and goes to
    ``out[out_rows[j]]`` (m0 unused)."""
    NUM_WARPS: gl.constexpr = ROW_TILES * SLICES
    ROWS: gl.constexpr = 16 * ROW_TILES              # output rows per program (of gate, of up and of h)
    TILE: gl.constexpr = 16 * NUM_WARPS              # tile row t: slice t // ROWS, output row t % ROWS
    BG: gl.constexpr = 4 * KREP                       # groups per step (4 lanes x KREP registers)
    BK: gl.constexpr = 8 * BG
    BOOKS: gl.constexpr = 2 - SHARED_BOOKS            # codebook pairs staged (1: gate and up share one)
    UP_BASE: gl.constexpr = 512 * COPIES * 16 * (BOOKS - 1)   # bytes from the gate's copies to the up's
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=8)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=8)
    L3: gl.constexpr = _tile_layout(TILE, KREP, NUM_WARPS)
    L_TG: gl.constexpr = gl.SliceLayout(2, L3)        # [TILE, BG] in tile order
    L_C: gl.constexpr = _codes_layout(TILE, KREP, NUM_WARPS)
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    PEAKS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    # the first and largest shared allocation: global_smem + 0, where the lookups' PTX reads
    cb_smem = gl.allocate_shared_memory(dtype, [BOOKS * 512, COPIES, 8], FLAT)
    g_maxima = gl.allocate_shared_memory(gl.int32, [NUM_WARPS], PEAKS)
    u_maxima = gl.allocate_shared_memory(gl.int32, [NUM_WARPS], PEAKS)

    # ---- stage 1 (first step): both weights' code pairs of each tile row's output row and K slice,
    # memory order (HBM -> registers). Rows past N are clamped to N - 1 (in bounds, never stored);
    # groups past the slice's end (or K's) read code 0 and are zeroed below.
    cr = gl.arange(0, TILE, layout=gl.SliceLayout(1, L_C))
    cg = gl.arange(0, BG, layout=gl.SliceLayout(0, L_C))
    c_start = (cr // ROWS) * GROUPS_PER_SLICE
    c_end = gl.minimum(c_start + GROUPS_PER_SLICE, NUM_GROUPS)
    c_grp = c_start[:, None] + cg[None, :]
    c_off = gl.minimum(pid * ROWS + cr % ROWS, N - 1)[:, None] * stride_cn + c_grp
    g_cptrs = g_codes_ptr + c_off
    u_cptrs = u_codes_ptr + c_off
    if EVEN:
        g_cw = gl.load(g_cptrs)
        u_cw = gl.load(u_cptrs)
    else:
        g_cw = gl.load(g_cptrs, mask=c_grp < c_end[:, None], other=0)
        u_cw = gl.load(u_cptrs, mask=c_grp < c_end[:, None], other=0)

    # ---- stage 0: both weights' codebooks (HBM/L2 -> registers -> SMEM), one weight after the
    # other (fewer registers live), one barrier for both; each weight scaled by its own f (and its
    # row scale by 1 / f) where C0[a] + C1[b] could overflow x's dtype ----
    _stage_codebooks(g_cb_ptr, cb_smem.slice(0, 512), g_maxima, dtype, COPIES, NUM_WARPS)
    if not SHARED_BOOKS:
        _stage_codebooks(u_cb_ptr, cb_smem.slice(512, 512), u_maxima, dtype, COPIES, NUM_WARPS)
    thread_barrier()
    g_factor, g_inverse = codebook_factor(g_maxima, dtype, NUM_WARPS)
    if SHARED_BOOKS:
        u_factor, u_inverse = g_factor, g_inverse
    else:
        u_factor, u_inverse = codebook_factor(u_maxima, dtype, NUM_WARPS)
    if g_factor != 1.0:
        _rescale_codebooks(g_cb_ptr, cb_smem.slice(0, 512), g_factor, dtype, COPIES, NUM_WARPS)
        thread_barrier()
    if not SHARED_BOOKS:
        if u_factor != 1.0:
            _rescale_codebooks(u_cb_ptr, cb_smem.slice(512, 512), u_factor, dtype, COPIES, NUM_WARPS)
            thread_barrier()

    # per-element constants of the A tiles (shared by both weights) and x's pointers
    copy_off, t_grp, t_end, k_first, x_col, x_ptrs, x_tok_ok = _step_operands(
        x_ptr, stride_xm, m0, M, NUM_GROUPS, GROUPS_PER_SLICE, TILE, ROWS, KREP, TOKENS, COPIES, SLICES, ROW_TILES,
        L_TG, B_OP, x_rows_ptr, GATHER)

    g_acc = gl.zeros([TILE, TOKENS], gl.float32, MMA)
    u_acc = gl.zeros([TILE, TOKENS], gl.float32, MMA)
    for step in range(0, GROUPS_PER_SLICE, BG):
        # stage 1: next step's codes of both weights first (their HBM latency hides behind this step)
        g_cptrs += BG
        u_cptrs += BG
        c_next_ok = (c_grp + (step + BG)) < c_end[:, None]
        g_next = gl.load(g_cptrs, mask=c_next_ok, other=0)
        u_next = gl.load(u_cptrs, mask=c_next_ok, other=0)
        # stage 2: both weight tiles from the SMEM copies (the up's UP_BASE bytes further)
        g_w = _weight_tile(g_cw, copy_off, 0, dtype, TILE, KREP, COPIES, NUM_WARPS)
        u_w = _weight_tile(u_cw, copy_off, UP_BASE, dtype, TILE, KREP, COPIES, NUM_WARPS)
        # stage 3: x^T once for both MMAs; masked tails: tokens past M and inputs past K read zero,
        # groups past the slice's end are zeroed in both tiles (an inf / NaN entry 0 must not meet
        # x's zeros there)
        if EVEN:
            xv = gl.load(x_ptrs, mask=x_tok_ok, other=0.0)
        else:
            k_ok = (k_first + step * 8 + x_col) < NUM_GROUPS * 8
            xv = gl.load(x_ptrs, mask=x_tok_ok & k_ok, other=0.0)
            g_ok = (t_grp + step) < t_end
            keep = gl.convert_layout(gl.reshape(gl.broadcast(g_ok[:, :, None], gl.zeros([TILE, BG, 8], gl.int1, L3))[0],
                                                [TILE, BK]), A_OP)
            g_w = gl.where(keep, g_w, gl.zeros_like(g_w))
            u_w = gl.where(keep, u_w, gl.zeros_like(u_w))
        g_acc = mma_v2(g_w, xv, g_acc)
        u_acc = mma_v2(u_w, xv, u_acc)
        x_ptrs += BK
        g_cw = g_next
        u_cw = u_next
    cb_smem._keep_alive()   # the PTX lookups are invisible to the allocator: hold the copies to here

    # ---- stage 4: both weights' slice partials meet in SMEM (fixed order), scales, biases, silu * up ----
    if SLICES > 1:
        EPI: gl.constexpr = _epilogue_layout(TOKENS, NUM_WARPS)
        thread_barrier()    # every warp's lookups are done: the buffer may reuse the copies' bytes
        parts = gl.allocate_shared_memory(gl.float32, [2 * TILE, TOKENS], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        parts.slice(0, TILE).store(g_acc)
        parts.slice(TILE, TILE).store(u_acc)
        thread_barrier()
        g = parts.slice(0, ROWS).load(EPI)
        u = parts.slice(TILE, ROWS).load(EPI)
        for s in gl.static_range(1, SLICES):
            g += parts.slice(s * ROWS, ROWS).load(EPI)
            u += parts.slice(TILE + s * ROWS, ROWS).load(EPI)
        rows = pid * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, EPI))
        toks = m0 + gl.arange(0, TOKENS, layout=gl.SliceLayout(0, EPI))
        if GATHER:
            _swiglu_finish_rows(g, u, rows, toks, M, N, g_scales_ptr, u_scales_ptr, out_ptr, stride_om, g_inverse,
                                u_inverse, out_rows_ptr)
        else:
            _swiglu_finish(g, u, rows, toks, M, N, g_scales_ptr, g_bias_ptr, u_scales_ptr, u_bias_ptr, out_ptr,
                           stride_om, g_inverse, u_inverse, GATE_BIAS, UP_BIAS)
    else:
        rows = pid * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, MMA))
        toks = m0 + gl.arange(0, TOKENS, layout=gl.SliceLayout(0, MMA))
        if GATHER:
            _swiglu_finish_rows(g_acc, u_acc, rows, toks, M, N, g_scales_ptr, u_scales_ptr, out_ptr, stride_om,
                                g_inverse, u_inverse, out_rows_ptr)
        else:
            _swiglu_finish(g_acc, u_acc, rows, toks, M, N, g_scales_ptr, g_bias_ptr, u_scales_ptr, u_bias_ptr,
                           out_ptr, stride_om, g_inverse, u_inverse, GATE_BIAS, UP_BIAS)


@gluon.jit
def vq_swiglu_kernel(
    # pointers (codes read as int16 [N, NUM_GROUPS]: low byte codebook 0, high byte codebook 1)
    x_ptr, g_codes_ptr, g_cb_ptr, g_scales_ptr, g_bias_ptr, u_codes_ptr, u_cb_ptr, u_scales_ptr, u_bias_ptr, out_ptr,
    # sizes (GROUPS_PER_SLICE: a multiple of 4 * KREP)
    M, N, NUM_GROUPS, GROUPS_PER_SLICE,
    # strides (both codes tensors contiguous: one row stride)
    stride_xm, stride_cn, stride_om,
    # meta-parameters: kernels_small.vq_small_kernel's, a bias flag per weight
    TOKENS: gl.constexpr, KREP: gl.constexpr, ROW_TILES: gl.constexpr, SLICES: gl.constexpr,
    COPIES: gl.constexpr, GATE_BIAS: gl.constexpr, UP_BIAS: gl.constexpr, EVEN: gl.constexpr,
):
    # grid: (row blocks, token tiles of TOKENS tokens); each weight its own codebooks
    swiglu_program(x_ptr, g_codes_ptr, g_cb_ptr, g_scales_ptr, g_bias_ptr, u_codes_ptr, u_cb_ptr, u_scales_ptr,
                   u_bias_ptr, out_ptr, gl.program_id(0), gl.program_id(1) * TOKENS, M, N, NUM_GROUPS,
                   GROUPS_PER_SLICE, stride_xm, stride_cn, stride_om, TOKENS, KREP, ROW_TILES, SLICES, COPIES,
                   GATE_BIAS, UP_BIAS, EVEN, False)


@triton.jit
def tl_swiglu_program(x_ptr, g_codes_ptr, g_cb_ptr, g_scales_ptr, g_bias_ptr, u_codes_ptr, u_cb_ptr, u_scales_ptr,
                      u_bias_ptr, out_ptr, rows, toks, xrows, out_toks, M, N, NUM_GROUPS, GROUPS_PER_SLICE, stride_xm,
                      stride_cn, stride_om, ROWS: tl.constexpr, TOKENS: tl.constexpr, BG: tl.constexpr,
                      SLICES: tl.constexpr, GATE_BIAS: tl.constexpr, UP_BIAS: tl.constexpr):
    """:func:`swiglu_program` in ``tl``: per weight the sums over K of ``rows`` for tokens ``toks``
    (those below M; token j is x's row ``xrows[j]``: ``kernels_small._tl_projection``), the row
    scales times ``1 / f``, the biases, ``silu(g) * u`` in fp32, one rounding into
    ``out[out_toks[j], rows]`` (the weights' pointers may be offset by the caller, and may share
    codebooks)."""
    g, g_inverse = _tl_projection(x_ptr, g_codes_ptr, g_cb_ptr, rows, toks, xrows, M, N, NUM_GROUPS,
                                  GROUPS_PER_SLICE, stride_xm, stride_cn, ROWS, TOKENS, BG, SLICES)
    u, u_inverse = _tl_projection(x_ptr, u_codes_ptr, u_cb_ptr, rows, toks, xrows, M, N, NUM_GROUPS,
                                  GROUPS_PER_SLICE, stride_xm, stride_cn, ROWS, TOKENS, BG, SLICES)
    g = g * (tl.load(g_scales_ptr + rows, mask=rows < N, other=0.0).to(tl.float32) * g_inverse)[:, None]
    u = u * (tl.load(u_scales_ptr + rows, mask=rows < N, other=0.0).to(tl.float32) * u_inverse)[:, None]
    if GATE_BIAS:
        g += tl.load(g_bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[:, None]
    if UP_BIAS:
        u += tl.load(u_bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[:, None]
    h = g / (1.0 + tl.exp(-g)) * u
    ok = (rows[:, None] < N) & (toks[None, :] < M)
    tl.store(out_ptr + out_toks[None, :] * stride_om + rows[:, None], h.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def vq_swiglu_tl_kernel(
    x_ptr, g_codes_ptr, g_cb_ptr, g_scales_ptr, g_bias_ptr, u_codes_ptr, u_cb_ptr, u_scales_ptr, u_bias_ptr, out_ptr,
    M, N, NUM_GROUPS, GROUPS_PER_SLICE,
    stride_xm, stride_cn, stride_om,
    TOKENS: tl.constexpr, KREP: tl.constexpr, ROW_TILES: tl.constexpr, SLICES: tl.constexpr,
    COPIES: tl.constexpr, GATE_BIAS: tl.constexpr, UP_BIAS: tl.constexpr, EVEN: tl.constexpr,
):
    """:func:`vq_swiglu_kernel`'s decomposition in ``tl`` (the CPU-interpreted twin; same arguments,
    ``COPIES`` and ``EVEN`` unused): per weight, a program's ``16 * ROW_TILES`` rows over the whole
    of K in ``SLICES`` slices added in slice order, each weight ``f (C0[a] + C1[b])`` rounded once
    to x's dtype, the row scale times ``1 / f`` on the sums; then the biases and ``silu(g) * u`` in
    fp32, one rounding."""
    ROWS: tl.constexpr = 16 * ROW_TILES
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    toks = tl.program_id(1) * TOKENS + tl.arange(0, TOKENS)
    tl_swiglu_program(x_ptr, g_codes_ptr, g_cb_ptr, g_scales_ptr, g_bias_ptr, u_codes_ptr, u_cb_ptr, u_scales_ptr,
                      u_bias_ptr, out_ptr, rows, toks, toks, toks, M, N, NUM_GROUPS, GROUPS_PER_SLICE, stride_xm,
                      stride_cn, stride_om, ROWS, TOKENS, 4 * KREP, SLICES, GATE_BIAS, UP_BIAS)


@triton.jit
def vq_swiglu_epilogue_kernel(g_ptr, u_ptr, out_ptr, NUMEL, BLOCK: tl.constexpr):
    """The unfused path's epilogue (more tokens than the fused kernel's tiles, or a layer where two
    ``vq_matmul`` calls are faster): ``out = silu(g) * u`` over two projections' outputs ``g``,
    ``u`` (``[M, N]`` contiguous, x's dtype), flat, ``BLOCK`` elements per program. One launch where
    PyTorch's ``silu(g) * u`` takes two, and the product in fp32 with one rounding."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < NUMEL
    # both projections' outputs (HBM -> registers), SiLU times up in fp32 (registers -> HBM)
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=ok)
