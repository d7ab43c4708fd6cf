"""One-launch VQ kernel for small layers at 1-16 tokens: no split over programs, no workspace.

``y[m, n] = scale[n] * sum_k W'[n, k] x[m, k]`` with ``W'[n, 8g:8g+8] = C0[c0(n, g)] + C1[c1(n, g)]``.

On layers of a few million weights (MoE experts such as 2048 x 768, k/v projections such as
1024 x 4096) the MMA decode kernel (``kernels_mma.py``) is its fixed chain: 64 KB of codebook
copies per program, one or two K steps, then the split-K meeting in an fp32 workspace (an atomic
arrival and the last program's read-back: two more L2 round trips). This kernel keeps the MMA
decode's dequantization (weight tiles built in registers straight in ``mma.sync``'s A-operand
layout from shared-memory codebook copies) and drops the rest of the chain:

* a program owns ``ROWS = 16 * ROW_TILES`` output rows and the whole of K: no partial sums leave
  the program, so no workspace, no atomics, no arrival counter, and the sum's order is fixed
  (bit-identical results whatever else runs);
* K is split over the program's warps instead: warp ``w`` computes the ``ROWS`` rows' partial sums
  over K slice ``w // ROW_TILES`` (``GROUPS_PER_SLICE`` groups), and the slices meet in shared
  memory, added in slice order by every thread after one barrier;
* ``COPIES`` (1-8) copies of each codebook entry in shared memory (8 KB each in fp16): fewer
  copies cost bank conflicts in the lookups but less time filling them, which on a small layer is
  the larger share.

Stages:

* Stage 0 (HBM/L2 -> SMEM, once per program): both codebooks in x's dtype, ``COPIES`` times
  (``[2, 256, COPIES, 8]``), scaled by a power of two ``f`` where ``C0[a] + C1[b]`` could overflow
  x's dtype (``kernels_mma.codebook_factor``); the peak scan shares the copies' barrier.
* Stage 1 (HBM -> registers): the code pairs of the warp's 16 rows x ``4 * KREP`` groups of its K
  slice, one step ahead of use (the MMA decode kernel's layout: a thread's ``KREP`` groups of a row
  are one load).
* Stage 2 (SMEM -> registers): two ``ld.shared.v4`` and four packed adds per group (inline PTX),
  the weight tile in the A-operand layout; lane ``l`` reads copy ``(l % 8) % COPIES``.
* Stage 3 (L1/L2 -> registers -> tensor cores): the warp's slice of x^T ``[32 KREP, TOKENS]`` and
  ``mma.sync`` m16n8k16 into fp32. The mma operand x^T is warp-replicated in Triton's layouts; the
  warp's K offset is added to its pointers by one inline-PTX instruction that reads the warp index
  (``%tid.x / 32``), so each warp's copy of the operand holds its own slice. Nothing reads the
  operand across warps (the load is in the operand layout and feeds the MMA directly).
* Stage 4: the warps' partial sums into shared memory ``[SLICES * ROWS, TOKENS]`` fp32, one
  barrier, every slice added in order, then the row scale times ``1 / f``, the bias and the store.

The PTX lookups address Triton's ``global_smem`` symbol: the codebook copies are the first and
largest shared allocation live in the loop (checked on the compiled PTX by
``tests/test_vq_small.py``); the partial-sum buffer is allocated after the loop, behind a barrier
(the lookups are invisible to Triton's hazard analysis, and the buffer may reuse the copies' bytes).

:func:`vq_small_tl_kernel` is the same decomposition in ``tl`` (codebook rows gathered through L1,
one slice after the other, summed in slice order): the twin the CPU interpreter runs.
"""

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from tilefuse.ops.gluon_compat import thread_barrier
from tilefuse.ops.vq.kernels import _mma_steps
from tilefuse.ops.vq.kernels import codebook_factor as tl_codebook_factor
from tilefuse.ops.vq.kernels_mma import (DEQUANT_BF16, DEQUANT_F16, _codes_layout, _tile_layout, codebook_factor,
                                         codebook_peaks, codebook_scan)
from tilefuse.ops.vq.ptx import dequant_asm

DEQUANT_CON = gl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 16))   # 4 packed pairs out; 8 + 8 offsets in


def small_dequant_asm(kind: str, copies: int) -> str:
    """:func:`ptx.dequant_asm` with codebook 1 at ``256 * copies * 16`` bytes after codebook 0 (the
    copies' size for 16-bit values) instead of the MMA decode kernel's 8 copies' 32 KB."""
    asm = dequant_asm(kind)
    assert "[b+32768]" in asm, "ptx.dequant_asm: codebook 1's offset moved"
    return asm.replace("[b+32768]", f"[b+{256 * copies * 16}]")


@gluon.constexpr_function
def _dequant_ptx(is_fp16, copies):
    """:func:`small_dequant_asm` (the JIT takes constexpr globals only, so the string is edited here)."""
    asm = (DEQUANT_F16 if is_fp16 else DEQUANT_BF16).value
    return asm.replace("[b+32768]", f"[b+{256 * int(copies) * 16}]")


@gluon.constexpr_function
def _slice_offset_ptx(row_tiles):
    """``$0 = (warp index // ROW_TILES) * $1``: the warp's K slice times the slice's length."""
    shift = 5 + (int(row_tiles).bit_length() - 1)
    return f"{{ .reg .u32 t; mov.u32 t, %tid.x; shr.u32 t, t, {shift}; mul.lo.u32 $0, t, $1; }}"


@gluon.constexpr_function
def _copies_layout(copies, num_warps):
    """``[512 entries, COPIES, 8]``: a thread's 8 values of one entry's copy (one 16-byte store)."""
    copies, num_warps = int(copies), int(num_warps)
    return gl.BlockedLayout([1, 1, 8], [32 // copies, copies, 1], [num_warps, 1, 1], [2, 1, 0])


@gluon.constexpr_function
def _epilogue_layout(tokens, num_warps):
    tokens, num_warps = int(tokens), int(num_warps)
    return gl.BlockedLayout([1, 1], [32 // tokens, tokens], [num_warps, 1], [1, 0])


@gluon.jit
def _step_operands(x_ptr, stride_xm, m0, M, NUM_GROUPS, GROUPS_PER_SLICE, TILE: gl.constexpr, ROWS: gl.constexpr,
                   KREP: gl.constexpr, TOKENS: gl.constexpr, COPIES: gl.constexpr, SLICES: gl.constexpr,
                   ROW_TILES: gl.constexpr, L_TG: gl.constexpr, B_OP: gl.constexpr, x_rows_ptr=None,
                   GATHER: gl.constexpr = False):
    """The per-element constants of a program's A tiles ([TILE, BG], ``L_TG``) and its x pointers
    at step 0 ([BK, TOKENS], ``B_OP``), shared by every weight the program looks up: (the byte
    offset of the codebook copy a lane reads -- lane % 8 = (tg % 4) + 4 * (row % 2) --, the group
    tile group tg holds at step 0, the end of the tile row's K slice, the warp's K slice start in
    inputs, x's column of each (tile group, j) after the group permutation (the MMA decode
    kernel's), x's pointers, which tokens exist). ``GATHER``: the program's token j is x's row
    ``x_rows[j]`` for j < M (an MoE expert's tokens, ``kernels_moe``) instead of ``m0 + j``."""
    BG: gl.constexpr = 4 * KREP
    BK: gl.constexpr = 8 * BG
    tr = gl.arange(0, TILE, layout=gl.SliceLayout(1, L_TG))[:, None]
    tg = gl.arange(0, BG, layout=gl.SliceLayout(0, L_TG))[None, :]
    copy_off = (((tg % 4) + 4 * (tr % 2)) % COPIES) * 16
    t_start = (tr // ROWS) * GROUPS_PER_SLICE
    t_end = gl.minimum(t_start + GROUPS_PER_SLICE, NUM_GROUPS)
    t_grp = t_start + (tg % 4) * KREP + tg // 4       # the group that tile group tg holds at step 0
    xk = gl.arange(0, BK, layout=gl.SliceLayout(1, B_OP))
    x_col = (((xk // 8) % 4) * KREP + xk // 32) * 8 + xk % 8
    x_col = gl.max_contiguous(gl.multiple_of(x_col, 8), 8)[:, None]
    if GATHER:
        tj = gl.arange(0, TOKENS, layout=gl.SliceLayout(0, B_OP))
        xt = gl.load(x_rows_ptr + tj, mask=tj < M, other=0)[None, :]
        x_ok = tj[None, :] < M
    else:
        xt = m0 + gl.arange(0, TOKENS, layout=gl.SliceLayout(0, B_OP))[None, :]
        x_ok = xt < M
    # the warp's K slice start (inputs): per warp, read from %tid (the operand is warp-replicated)
    k_first = gl.zeros([BK, TOKENS], gl.int32, B_OP)
    if SLICES > 1:
        k_first = gl.inline_asm_elementwise(_slice_offset_ptx(ROW_TILES), "=r,r", [k_first + GROUPS_PER_SLICE * 8],
                                            gl.int32, True, 1)
        # one value per warp, a multiple of the step: x's loads stay 16-byte vectors
        k_first = gl.multiple_of(gl.max_constancy(k_first, [BK, TOKENS]), [8, 8])
    x_ptrs = x_ptr + xt * stride_xm + k_first + x_col
    return copy_off, t_grp, t_end, k_first, x_col, x_ptrs, x_ok


@gluon.jit
def _weight_tile(cw, copy_off, base, dtype: gl.constexpr, TILE: gl.constexpr, KREP: gl.constexpr,
                 COPIES: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Stage 2 for one weight: code pairs ``cw`` (``[TILE, BG]`` int16, memory order) -> the weight
    tile ``[TILE, BK]`` in the A-operand layout, ``C0[a] + C1[b]`` rounded once to x's dtype, read
    from the copies ``base`` bytes into ``global_smem`` (0: the small-layer kernel's and the gate's,
    ``512 * COPIES * 16``: the up's)."""
    BG: gl.constexpr = 4 * KREP
    BK: gl.constexpr = 8 * BG
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=8)
    L3: gl.constexpr = _tile_layout(TILE, KREP, NUM_WARPS)
    L_TG: gl.constexpr = gl.SliceLayout(2, L3)
    # tile order (the MMA decode kernel's group permutation), byte offsets of both entries' copies
    pair = gl.reshape(gl.permute(gl.reshape(cw.to(gl.int32) & 0xFFFF, [TILE, 4, KREP]), [0, 2, 1]), [TILE, BG])
    pair = gl.convert_layout(pair, L_TG)
    a0 = (pair & 0xFF) * (COPIES * 16) + copy_off + base
    a1 = (pair >> 8) * (COPIES * 16) + copy_off + base
    a0 = gl.convert_layout(gl.reshape(gl.broadcast(a0[:, :, None], gl.zeros([TILE, BG, 8], gl.int32, L3))[0],
                                      [TILE, BK]), A_OP)
    a1 = gl.convert_layout(gl.reshape(gl.broadcast(a1[:, :, None], gl.zeros([TILE, BG, 8], gl.int32, L3))[0],
                                      [TILE, BK]), A_OP)
    if dtype == gl.float16:
        w = gl.inline_asm_elementwise(_dequant_ptx(True, COPIES), DEQUANT_CON, [a0, a1], gl.float16, True, 8)
    else:
        w = gl.inline_asm_elementwise(_dequant_ptx(False, COPIES), DEQUANT_CON, [a0, a1], gl.bfloat16, True, 8)
    return w


@gluon.jit
def _finish(total, rows, toks, M, N, scales_ptr, bias_ptr, out_ptr, stride_om, inverse, HAS_BIAS: gl.constexpr):
    """``total`` ([ROWS, TOKENS] fp32 sums over K) times the row scale and ``1 / f``, plus the bias,
    into ``out[toks, rows]`` (rows past N and tokens past M are not written)."""
    scale = gl.load(scales_ptr + rows, mask=rows < N, other=0.0).to(gl.float32) * inverse
    total = total * scale[:, None]
    if HAS_BIAS:
        total += gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)[:, None]
    ok = (rows[:, None] < N) & (toks[None, :] < M)
    gl.store(out_ptr + toks[None, :] * stride_om + rows[:, None], total.to(out_ptr.dtype.element_ty), mask=ok)


@gluon.jit
def _finish_rows(total, rows, toks, M, N, scales_ptr, out_ptr, stride_om, inverse, out_rows_ptr, col_w_ptr,
                 WEIGHTED: gl.constexpr):
    """:func:`_finish` for gathered tokens: token j < M of the program goes to ``out[out_rows[j], rows]``,
    times ``col_w[out_rows[j]]`` where ``WEIGHTED`` (an MoE pair's routing weight)."""
    ok_t = toks < M
    out_row = gl.load(out_rows_ptr + toks, mask=ok_t, other=0)
    total = total * (gl.load(scales_ptr + rows, mask=rows < N, other=0.0).to(gl.float32) * inverse)[:, None]
    if WEIGHTED:
        total = total * gl.load(col_w_ptr + out_row, mask=ok_t, other=0.0).to(gl.float32)[None, :]
    ok = (rows[:, None] < N) & ok_t[None, :]
    gl.store(out_ptr + out_row[None, :] * stride_om + rows[:, None], total.to(out_ptr.dtype.element_ty), mask=ok)


@gluon.jit
def small_program(x_ptr, codes_ptr, cb_ptr, scales_ptr, bias_ptr, out_ptr, pid, m0, M, N, NUM_GROUPS,
                  GROUPS_PER_SLICE, stride_xm, stride_cn, stride_om, row_weight,
                  TOKENS: gl.constexpr, KREP: gl.constexpr, ROW_TILES: gl.constexpr, SLICES: gl.constexpr,
                  COPIES: gl.constexpr, HAS_BIAS: gl.constexpr, EVEN: gl.constexpr, x_rows_ptr=None,
                  out_rows_ptr=None, col_w_ptr=None, GATHER: gl.constexpr = False):
    """One program of the small-layer kernel: output rows ``pid * ROWS ...`` of tokens ``m0 ...
    m0 + TOKENS`` (those below M), every stage below; the sums times ``row_weight`` (fp32; 1 for
    :func:`vq_small_kernel`, the routing weight for the MoE down projection, ``kernels_moe``) into
    ``out[toks, rows]``. The weight's pointers (codes, codebooks, scales) may be offset by the caller.
    ``GATHER`` (an MoE expert's tokens, no bias): token j < M is x's row ``x_rows[j]`` and goes to
    ``out[out_rows[j]]`` times ``col_w[out_rows[j]]`` (:func:`_finish_rows`; m0 unused)."""
    NUM_WARPS: gl.constexpr = ROW_TILES * SLICES
    ROWS: gl.constexpr = 16 * ROW_TILES              # output rows per program
    TILE: gl.constexpr = 16 * NUM_WARPS              # tile row t: slice t // ROWS, output row t % ROWS
    BG: gl.constexpr = 4 * KREP                       # groups per step (4 lanes x KREP registers)
    BK: gl.constexpr = 8 * BG
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=8)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=8)
    L3: gl.constexpr = _tile_layout(TILE, KREP, NUM_WARPS)
    L_TG: gl.constexpr = gl.SliceLayout(2, L3)        # [TILE, BG] in tile order
    L_C: gl.constexpr = _codes_layout(TILE, KREP, NUM_WARPS)
    CB: gl.constexpr = _copies_layout(COPIES, NUM_WARPS)
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])

    cb_smem = gl.allocate_shared_memory(dtype, [2 * 256, COPIES, 8], FLAT)
    maxima = gl.allocate_shared_memory(gl.int32, [NUM_WARPS], gl.SwizzledSharedLayout(1, 1, 1, [0]))

    # ---- stage 1 (first step): code pairs of each tile row's output row and K slice, memory order
    # (HBM -> registers). Rows past N are clamped to N - 1 (in bounds, never stored); groups past
    # the slice's end (or K's) read code 0 and are zeroed below.
    cr = gl.arange(0, TILE, layout=gl.SliceLayout(1, L_C))
    cg = gl.arange(0, BG, layout=gl.SliceLayout(0, L_C))
    c_start = (cr // ROWS) * GROUPS_PER_SLICE
    c_end = gl.minimum(c_start + GROUPS_PER_SLICE, NUM_GROUPS)
    c_grp = c_start[:, None] + cg[None, :]
    c_ptrs = codes_ptr + gl.minimum(pid * ROWS + cr % ROWS, N - 1)[:, None] * stride_cn + c_grp
    if EVEN:
        cw = gl.load(c_ptrs)
    else:
        cw = gl.load(c_ptrs, mask=c_grp < c_end[:, None], other=0)

    # ---- stage 0: codebooks (HBM/L2 -> registers -> SMEM), COPIES copies of each entry, x's dtype;
    # scaled by f (and the row scale by 1 / f) where C0[a] + C1[b] could overflow x's dtype ----
    scan = codebook_scan(cb_ptr, NUM_WARPS)
    ce = gl.arange(0, 512, layout=gl.SliceLayout(1, gl.SliceLayout(2, CB)))[:, None, None]
    cj = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, CB)))[None, None, :]
    cc = gl.arange(0, COPIES, layout=gl.SliceLayout(0, gl.SliceLayout(2, CB)))[None, :, None]
    cb_smem.store(gl.load(cb_ptr + ce * 8 + cj + cc * 0).to(dtype))
    codebook_peaks(scan, maxima)
    thread_barrier()
    factor, inverse = codebook_factor(maxima, dtype, NUM_WARPS)
    if factor != 1.0:   # rare: store the copies again, scaled (exact: f is a power of two)
        entries = gl.load(cb_ptr + ce * 8 + cj + cc * 0)
        cb_smem.store((entries * factor.to(entries.dtype)).to(dtype))
        thread_barrier()

    # per-element constants of the A tile and x's pointers (the copy a lane reads, the tile row's
    # slice, x's permuted columns, the warp's K slice start)
    copy_off, t_grp, t_end, k_first, x_col, x_ptrs, x_tok_ok = _step_operands(
        x_ptr, stride_xm, m0, M, NUM_GROUPS, GROUPS_PER_SLICE, TILE, ROWS, KREP, TOKENS, COPIES, SLICES, ROW_TILES,
        L_TG, B_OP, x_rows_ptr, GATHER)

    acc = gl.zeros([TILE, TOKENS], gl.float32, MMA)
    for step in range(0, GROUPS_PER_SLICE, BG):
        # next step's codes first: their HBM latency hides behind this step's lookups and MMAs
        c_ptrs += BG
        cw_next = gl.load(c_ptrs, mask=(c_grp + (step + BG)) < c_end[:, None], other=0)
        # the step's weight tile from the SMEM codebook copies (code pairs -> C0[a] + C1[b])
        w = _weight_tile(cw, copy_off, 0, dtype, TILE, KREP, COPIES, NUM_WARPS)
        if EVEN:
            xv = gl.load(x_ptrs, mask=x_tok_ok, other=0.0)
        else:
            k_ok = (k_first + step * 8 + x_col) < NUM_GROUPS * 8
            xv = gl.load(x_ptrs, mask=x_tok_ok & k_ok, other=0.0)
            g_ok = (t_grp + step) < t_end
            w = gl.where(gl.convert_layout(gl.reshape(gl.broadcast(g_ok[:, :, None],
                                                                   gl.zeros([TILE, BG, 8], gl.int1, L3))[0],
                                                      [TILE, BK]), A_OP), w, gl.zeros_like(w))
        acc = mma_v2(w, xv, acc)
        x_ptrs += BK
        cw = cw_next
    cb_smem._keep_alive()   # the PTX lookups are invisible to the allocator: hold the copies to here

    # ---- stage 4: the slices' partial sums meet in SMEM (fixed order), scale, bias, output ----
    if SLICES > 1:
        EPI: gl.constexpr = _epilogue_layout(TOKENS, NUM_WARPS)
        thread_barrier()    # every warp's lookups are done: the buffer may reuse the copies' bytes
        parts = gl.allocate_shared_memory(gl.float32, [TILE, TOKENS], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        parts.store(acc)
        thread_barrier()
        total = parts.slice(0, ROWS).load(EPI)
        for s in gl.static_range(1, SLICES):
            total += parts.slice(s * ROWS, ROWS).load(EPI)
        rows = pid * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, EPI))
        toks = m0 + gl.arange(0, TOKENS, layout=gl.SliceLayout(0, EPI))
        if GATHER:
            _finish_rows(total, rows, toks, M, N, scales_ptr, out_ptr, stride_om, inverse, out_rows_ptr, col_w_ptr,
                         True)
        else:
            _finish(total, rows, toks, M, N, scales_ptr, bias_ptr, out_ptr, stride_om, inverse * row_weight,
                    HAS_BIAS)
    else:
        rows = pid * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, MMA))
        toks = m0 + gl.arange(0, TOKENS, layout=gl.SliceLayout(0, MMA))
        if GATHER:
            _finish_rows(acc, rows, toks, M, N, scales_ptr, out_ptr, stride_om, inverse, out_rows_ptr, col_w_ptr, True)
        else:
            _finish(acc, rows, toks, M, N, scales_ptr, bias_ptr, out_ptr, stride_om, inverse * row_weight, HAS_BIAS)


@gluon.jit
def vq_small_kernel(
    # pointers (codes read as int16 [N, NUM_GROUPS]: low byte codebook 0, high byte codebook 1)
    x_ptr, codes_ptr, cb_ptr, scales_ptr, bias_ptr, out_ptr,
    # sizes (GROUPS_PER_SLICE: a multiple of 4 * KREP)
    M, N, NUM_GROUPS, GROUPS_PER_SLICE,
    # strides
    stride_xm, stride_cn, stride_om,
    # meta-parameters: 16 * ROW_TILES rows and TOKENS tokens (8 or 16) per program, K over SLICES
    # warp groups, KREP * 32 inputs per step, COPIES copies of each codebook entry
    TOKENS: gl.constexpr, KREP: gl.constexpr, ROW_TILES: gl.constexpr, SLICES: gl.constexpr,
    COPIES: gl.constexpr, HAS_BIAS: gl.constexpr, EVEN: gl.constexpr,
):
    # grid: (row blocks, token tiles of TOKENS tokens)
    small_program(x_ptr, codes_ptr, cb_ptr, scales_ptr, bias_ptr, out_ptr, gl.program_id(0),
                  gl.program_id(1) * TOKENS, M, N, NUM_GROUPS, GROUPS_PER_SLICE, stride_xm, stride_cn, stride_om,
                  1.0, TOKENS, KREP, ROW_TILES, SLICES, COPIES, HAS_BIAS, EVEN)


@triton.jit
def _tl_projection(x_ptr, codes_ptr, cb_ptr, rows, toks, xrows, M, N, NUM_GROUPS, GROUPS_PER_SLICE, stride_xm,
                   stride_cn, ROWS: tl.constexpr, TOKENS: tl.constexpr, BG: tl.constexpr, SLICES: tl.constexpr):
    """One weight's ``[ROWS, TOKENS]`` fp32 sums over K in ``SLICES`` slices added in slice order
    (the ``tl`` twins' loop), and its ``1 / f``. Token j (``toks[j]`` below M) is x's row ``xrows[j]``."""
    factor, inverse = tl_codebook_factor(cb_ptr, x_ptr.dtype.element_ty)
    total = tl.zeros([ROWS, TOKENS], dtype=tl.float32)
    for s in tl.static_range(SLICES):
        g_begin = s * GROUPS_PER_SLICE
        g_end = tl.minimum(g_begin + GROUPS_PER_SLICE, NUM_GROUPS)
        c_ptrs = codes_ptr + tl.minimum(rows, N - 1)[:, None] * stride_cn + g_begin + tl.arange(0, BG)[None, :]
        x_ptrs = x_ptr + xrows[None, :] * stride_xm + g_begin * 8 + tl.arange(0, 8 * BG)[:, None]
        part = tl.zeros([ROWS, TOKENS], dtype=tl.float32)
        if factor == 1.0:
            part = _mma_steps(part, c_ptrs, x_ptrs, cb_ptr, toks, M, g_begin, g_end, factor, BG, 8 * BG, False)
        else:
            part = _mma_steps(part, c_ptrs, x_ptrs, cb_ptr, toks, M, g_begin, g_end, factor, BG, 8 * BG, True)
        total += part
    return total, inverse


@triton.jit
def tl_small_program(x_ptr, codes_ptr, cb_ptr, scales_ptr, bias_ptr, out_ptr, rows, toks, xrows, out_toks, M, N,
                     NUM_GROUPS, GROUPS_PER_SLICE, stride_xm, stride_cn, stride_om, col_weight, ROWS: tl.constexpr,
                     TOKENS: tl.constexpr, BG: tl.constexpr, SLICES: tl.constexpr, HAS_BIAS: tl.constexpr):
    """:func:`small_program` in ``tl``: output ``rows`` of tokens ``toks`` (those below M; token j
    is x's row ``xrows[j]`` and goes to ``out[out_toks[j]]``), the sums over K
    (:func:`_tl_projection`) times the row scale, ``1 / f`` and ``col_weight`` (a scalar, or
    ``[1, TOKENS]``), plus the bias."""
    total, inverse = _tl_projection(x_ptr, codes_ptr, cb_ptr, rows, toks, xrows, M, N, NUM_GROUPS, GROUPS_PER_SLICE,
                                    stride_xm, stride_cn, ROWS, TOKENS, BG, SLICES)
    scale = tl.load(scales_ptr + rows, mask=rows < N, other=0.0).to(tl.float32) * inverse
    total = total * scale[:, None] * col_weight
    if HAS_BIAS:
        total += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[:, None]
    ok = (rows[:, None] < N) & (toks[None, :] < M)
    tl.store(out_ptr + out_toks[None, :] * stride_om + rows[:, None], total.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def vq_small_tl_kernel(
    x_ptr, codes_ptr, cb_ptr, scales_ptr, bias_ptr, out_ptr,
    M, N, NUM_GROUPS, GROUPS_PER_SLICE,
    stride_xm, stride_cn, stride_om,
    TOKENS: tl.constexpr, KREP: tl.constexpr, ROW_TILES: tl.constexpr, SLICES: tl.constexpr,
    COPIES: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr,
):
    """:func:`vq_small_kernel`'s decomposition in ``tl`` (the CPU-interpreted twin; same arguments,
    ``COPIES`` and ``EVEN`` unused): a program's ``16 * ROW_TILES`` rows over the whole of K, K in
    ``SLICES`` slices of ``GROUPS_PER_SLICE`` groups whose fp32 partial sums are added in slice
    order; each weight ``f (C0[a] + C1[b])`` rounded once to x's dtype, the row scale times ``1 / f``
    applied to the sum (``kernels._mma_steps``, ``kernels.codebook_factor``)."""
    ROWS: tl.constexpr = 16 * ROW_TILES
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    toks = tl.program_id(1) * TOKENS + tl.arange(0, TOKENS)
    tl_small_program(x_ptr, codes_ptr, cb_ptr, scales_ptr, bias_ptr, out_ptr, rows, toks, toks, toks, M, N,
                     NUM_GROUPS, GROUPS_PER_SLICE, stride_xm, stride_cn, stride_om, 1.0, ROWS, TOKENS, 4 * KREP,
                     SLICES, HAS_BIAS)
