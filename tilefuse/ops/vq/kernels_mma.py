"""Gluon decode kernel for 2-16 tokens: dequantize weight tiles in registers, tensor-core MMA.

``y[m, n] = scale[n] * sum_k W'[n, k] x[m, k]`` with ``W'[n, 8g:8g+8] = C0[c0(n, g)] + C1[c1(n, g)]``
(GPU only, sm_80+). Swap-AB: the weight tile is the MMA's A operand (``[BLOCK_N rows, BK]``), x^T the
B operand (``[BK, TOKENS]``, 16 or more), so every token count up to 16 costs the same lookups: two 16-byte
codebook reads per 8 weights, whatever the tokens (the table kernels' lookups grow with them).

* Stage 0 (HBM/L2 -> SMEM, once per program): both codebooks in x's dtype, each entry stored 8
  times side by side (``[2, 256, 8 copies, 8]``, 64 KB): lane ``l`` of a quarter warp reads copy
  ``l % 8``, so the 8 lanes of every ``ld.shared.v4`` phase hit 8 distinct bank quads whatever the
  codes are (conflict free). Times a power of two ``f`` (1 unless ``C0[a] + C1[b]`` could
  overflow x's dtype: the note above ``codebook_factor``).
* Stage 1 (HBM -> registers, streamed): the code pairs of ``BLOCK_N`` rows x ``BG`` groups as int16
  (low byte codebook 0), one step ahead of use. A thread holds ``KREP`` consecutive groups of a row
  (one ``2 * KREP``-byte load).
* Stage 2 (SMEM -> registers): the weight tile is built directly in the MMA's A-operand layout
  with ``k_width = 8``: a thread's 8 consecutive k of a row are exactly one group, so each group is
  one inline-PTX block -- two ``ld.shared.v4`` (C0 and C1 rows, 8 values each) and four packed
  adds (one rounding to x's dtype) -- with no shuffles or layout conversion. The MMA sums over k
  in any order as long as A and B agree, so the tile's group columns are a permutation of the
  step's groups (the one that makes a thread's code pairs contiguous in memory); x is read with
  the same permutation.
* Stage 3 (L1/L2 -> registers -> tensor cores): x^T for the step (16-byte loads, tokens past M
  read as zero) and ``mma.sync`` m16n8k16, fp32 accumulators ``[BLOCK_N, TOKENS]``. More than
  ``TOKENS`` tokens: a third grid axis of token tiles (then without split-K).
* Stage 4: the row scale times ``1 / f`` (it factors out of the sum over k); split-K partials meet in an fp32
  workspace ``[TOKENS, N]`` with one arrival counter per row block; the last program adds the bias,
  writes the output and re-zeroes workspace and counter (no zeroing launch, CUDA-graph safe).

The PTX addresses Triton's ``global_smem`` symbol: the codebook copies are the kernel's only
large explicit shared allocation (beside ``NUM_WARPS`` int32 for ``codebook_factor``) and Triton's
allocator puts them at offset 0 (checked in the PTX with tilefuse.testing.gluon; the GPU tests
would see another placement as wrong results).
``kernels.vq_mma_kernel`` is the same schedule in ``tl`` (codebooks read through L1), the one the
CPU tests run.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from tilefuse.ops.gluon_compat import thread_barrier

from tilefuse.ops.vq.ptx import dequant_asm

COPIES = gl.constexpr(8)              # copies of each codebook entry in shared memory
DEQUANT_F16 = gl.constexpr(dequant_asm("f16"))
DEQUANT_BF16 = gl.constexpr(dequant_asm("bf16"))
DEQUANT_CON = gl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 16))   # 4 packed pairs out; 8 + 8 offsets in


@gluon.constexpr_function
def _tile_layout(block_n, krep, num_warps):
    """The A operand (``mma_v2``, ``k_width = 8``) as ``[rows, tile group tg, j]``: j (3 bits) and then
    row + 8 in registers, tg % 4 on lanes 0-1, row % 8 on lanes 2-4, tg // 4 and the further 16-row
    tiles in registers, warps over 16-row tiles (what ``gl.to_linear_layout`` prints for A_OP)."""
    block_n, krep, num_warps = int(block_n), int(krep), int(num_warps)
    _log2_range = lambda n: range(max(n, 1).bit_length() - 1)  # noqa: E731
    reg = [[0, 0, 1], [0, 0, 2], [0, 0, 4], [8, 0, 0]] + [[0, 4 << i, 0] for i in _log2_range(krep)] + \
        [[16 * num_warps << i, 0, 0] for i in _log2_range(block_n // (16 * num_warps))]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
                                      warp_bases=[[16 << i, 0, 0] for i in _log2_range(num_warps)], block_bases=[],
                                      shape=[block_n, 4 * krep, 8])


@gluon.constexpr_function
def _codes_layout(block_n, krep, num_warps):
    """The same threads' code pairs ``[rows, group]`` in memory order: group ``a * KREP + b`` of a
    step (a = lane bits 0-1, b = register) is tile group ``b * 4 + a``, so a thread's KREP groups of
    a row are contiguous (one load)."""
    block_n, krep, num_warps = int(block_n), int(krep), int(num_warps)
    _log2_range = lambda n: range(max(n, 1).bit_length() - 1)  # noqa: E731
    reg = [[0, 1 << i] for i in _log2_range(krep)] + [[8, 0]] + \
        [[16 * num_warps << i, 0] for i in _log2_range(block_n // (16 * num_warps))]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[0, krep], [0, 2 * krep], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16 << i, 0] for i in _log2_range(num_warps)], block_bases=[],
                                      shape=[block_n, 4 * krep])


@gluon.constexpr_function
def _overflow_ratio(dtype):
    """``2^SHIFT * 2 / LIMIT`` with LIMIT the largest finite value of x's dtype (what ``C0[a] + C1[b]``
    must not exceed) and SHIFT (:func:`_overflow_shift`) keeping the ratio a normal fp32 number."""
    return 2.0 / 65504.0 if dtype.is_fp16() else 2.0 ** 32 * 2.0 / 3.3895313892515355e38


@gluon.constexpr_function
def _overflow_shift(dtype):
    return 0 if dtype.is_fp16() else 32


# Codebooks whose sums overflow x's dtype. The MMA operand is ``C0[a] + C1[b]`` in x's dtype, the
# row scale applied to the fp32 sums (it factors out of the sum over k): fp16 codebooks with
# entries above 32752 (or fp32 ones beyond x's range) overflow there to inf although the scaled
# weight the reference builds (fp32 sum, then the scale) is finite. Applying the scale per weight
# before the rounding would add instructions to every lookup of the loop (fp32 converts, a
# multiply and a repack per pair instead of one packed add), and a scale folded into the
# codebooks at plan time cannot be per row. Instead the codebook copies are scaled once per
# program by a power of two f and the row scale by 1 / f: exact (short of subnormals), and the
# loop is unchanged. f is 1 unless twice the codebooks' largest finite magnitude exceeds the
# dtype's largest value (``codebook_factor``). The common case costs, per program: one coalesced
# 16-byte load per lane beside the copies' loads, a warp reduction (``redux.sync``, no
# shuffles), one shared store and NUM_WARPS shared loads after the barrier the copies need
# anyway, and a branch not taken; only codebooks that need f != 1 are stored again, scaled,
# behind a second barrier. Measured (H200, CUDA-graph replay, against the kernel without it):
# within 2 % at 3-16 tokens on 4096 x 4096, within 3 % at 8192 x 8192, within noise on larger
# layers. ``kernels.codebook_factor`` computes the same f in ``tl``.


@gluon.constexpr_function
def _peak_layout(num_warps):
    """``[NUM_WARPS, 4096 / (256 NUM_WARPS), 32, 8]``: warp w's share of the 4096 codebook values in
    chunks of 256 (one 16-byte load per lane, the warp's 512 bytes contiguous), chunks and the 8
    values in registers."""
    num_warps = int(num_warps)
    return gl.BlockedLayout([1, 4096 // (256 * num_warps), 1, 8], [1, 1, 32, 1], [num_warps, 1, 1, 1], [3, 1, 2, 0])


@gluon.constexpr_function
def _broadcast_layout(n, num_warps):
    """``[n]`` held whole by every thread (lane and warp bases zero): reduced in registers."""
    n, num_warps = int(n), int(num_warps)
    return gl.DistributedLinearLayout(reg_bases=[[1 << i] for i in range(n.bit_length() - 1)],
                                      lane_bases=[[0]] * 5, warp_bases=[[0]] * (num_warps.bit_length() - 1),
                                      block_bases=[], shape=[n])


@gluon.jit
def codebook_scan(cb_ptr, NUM_WARPS: gl.constexpr):
    """The 4096 codebook values, each thread its share (load first, with the copies' load)."""
    L: gl.constexpr = _peak_layout(NUM_WARPS)
    CHUNKS: gl.constexpr = 4096 // (256 * NUM_WARPS)
    w = gl.arange(0, NUM_WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L))))
    i = gl.arange(0, CHUNKS, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L))))
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L))))
    j = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L))))
    offs = ((w[:, None, None, None] * CHUNKS + i[None, :, None, None]) * 32 + lane[None, None, :, None]) * 8 + \
        j[None, None, None, :]
    return gl.load(cb_ptr + offs)


@gluon.jit
def codebook_peaks(scan, maxima):
    """Each warp's largest finite magnitude of its ``scan`` values into ``maxima`` (shared
    ``[NUM_WARPS]`` int32, as bit patterns: non-negative floats order as their bits do, and Triton
    reduces int32 across a warp with ``redux.sync``, sm_80+). Non-finite entries are left out
    (they give inf / NaN where used, as in the reference). Store after the copies (the first
    shared store is theirs: the compile test reads their offset from it); read after a barrier."""
    v = gl.abs(scan.to(gl.float32))
    v = gl.max(gl.max(gl.where(v < float("inf"), v, gl.zeros_like(v)), axis=3), axis=1)     # in registers
    maxima.store(gl.max(v.to(gl.int32, bitcast=True), axis=1))


@gluon.jit
def codebook_factor(maxima, DTYPE: gl.constexpr, NUM_WARPS: gl.constexpr):
    """``(f, 1 / f)`` from the warps' maxima (after a barrier): the largest power of two ``f <= 1``
    with ``2 max |C| f`` at most the largest finite value of x's dtype ``DTYPE``."""
    big = gl.max(maxima.load(_broadcast_layout(NUM_WARPS, NUM_WARPS)), axis=0).to(gl.float32, bitcast=True)
    # the smallest e >= 0 with 2 big 2^-e <= LIMIT: the exponent of 2 big / LIMIT rounded up (bits)
    r = (big * _overflow_ratio(DTYPE)).to(gl.int32, bitcast=True)
    e = ((r >> 23) & 0xFF) - (127 + _overflow_shift(DTYPE)) + (r & 0x7FFFFF != 0).to(gl.int32)
    e = gl.minimum(gl.maximum(e, 0), 126)
    return ((127 - e) << 23).to(gl.float32, bitcast=True), ((127 + e) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _split_finish(total, rows, toks, M, N, out_ptr, ws_ptr, cnt_ptr, bias_ptr, stride_om, pid_n, SPLIT_K,
                  SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr):
    """``total`` ([R, T] fp32, scaled partial sums of this program) -> ``out`` (+ bias). Split-K: fp32
    atomics into ``ws`` ([T, N], zero between calls) and the row block's arrival counter; the last
    program reads the sums back where the atomics landed (L2), writes them and leaves zeros."""
    ok = (rows[:, None] < N) & (toks[None, :] < M)
    if SPLIT:
        ws_ptrs = ws_ptr + toks[None, :] * N + rows[:, None]
        gl.atomic_add(ws_ptrs, total, mask=ok, sem="relaxed")
        thread_barrier()   # every thread's atomics are issued before the arrival (release)
        arrived = gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            zero = gl.zeros_like(total)
            total = gl.atomic_add(ws_ptrs, zero, mask=ok, sem="relaxed")
            gl.store(ws_ptrs, zero, mask=ok)
            if HAS_BIAS:
                total += gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)[:, None]
            gl.store(out_ptr + toks[None, :] * stride_om + rows[:, None], total.to(out_ptr.dtype.element_ty),
                     mask=ok)
            gl.store(cnt_ptr + pid_n, 0)
    else:
        if HAS_BIAS:
            total += gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)[:, None]
        gl.store(out_ptr + toks[None, :] * stride_om + rows[:, None], total.to(out_ptr.dtype.element_ty), mask=ok)


@gluon.jit
def vq_decode_mma_kernel(
    # pointers (codes read as int16 [N, NUM_GROUPS]: low byte codebook 0, high byte codebook 1)
    x_ptr, codes_ptr, cb_ptr, scales_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    # sizes
    M, N, NUM_GROUPS, GROUPS_PER_SPLIT, SPLIT_K,
    # strides
    stride_xm, stride_cn, stride_om,
    # meta-parameters: BLOCK_N rows and TOKENS tokens (>= 16) per program, KREP * 32 inputs per step
    BLOCK_N: gl.constexpr, TOKENS: gl.constexpr, KREP: gl.constexpr, NUM_WARPS: gl.constexpr,
    SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, EVEN: gl.constexpr,
):
    BG: gl.constexpr = 4 * KREP                        # groups per step (4 lanes x KREP registers)
    BK: gl.constexpr = 8 * BG
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=8)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=8)
    L3: gl.constexpr = _tile_layout(BLOCK_N, KREP, NUM_WARPS)
    L_TG: gl.constexpr = gl.SliceLayout(2, L3)        # [BLOCK_N, BG] in tile order
    L_C: gl.constexpr = _codes_layout(BLOCK_N, KREP, NUM_WARPS)
    CB: gl.constexpr = gl.BlockedLayout([1, 1, 8], [4, 8, 1], [NUM_WARPS, 1, 1], [2, 1, 0])
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])

    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    m0 = gl.program_id(2) * TOKENS                    # token tiles (more than 16 tokens; no split-K then)
    g_begin = pid_k * GROUPS_PER_SPLIT
    g_end = gl.minimum(g_begin + GROUPS_PER_SPLIT, NUM_GROUPS)
    cb_smem = gl.allocate_shared_memory(dtype, [2 * 256, COPIES, 8], FLAT)
    maxima = gl.allocate_shared_memory(gl.int32, [NUM_WARPS], gl.SwizzledSharedLayout(1, 1, 1, [0]))

    # ---- stage 1 (first step): code pairs of the program's rows, memory order (HBM -> registers).
    # Rows past N are clamped to N - 1 (in bounds, never stored); groups past g_end read code 0.
    cr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_C))
    cg = gl.arange(0, BG, layout=gl.SliceLayout(0, L_C))
    c_ptrs = codes_ptr + gl.minimum(pid_n * BLOCK_N + cr, N - 1)[:, None] * stride_cn + (g_begin + cg)[None, :]
    if EVEN:
        cw = gl.load(c_ptrs)
    else:
        cw = gl.load(c_ptrs, mask=(g_begin + cg < g_end)[None, :], other=0)

    # ---- stage 0: codebooks (HBM/L2 -> registers -> SMEM), 8 copies of each entry, x's dtype;
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

    # per-element constants of the A tile: the copy a lane reads (lane % 8 = (tg % 4) + 4 * (row % 2))
    # as a byte offset, and x's column of each (tile group, j) after the group permutation
    tr = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_TG))[:, None]
    tg = gl.arange(0, BG, layout=gl.SliceLayout(0, L_TG))[None, :]
    copy_off = ((tg % 4) + 4 * (tr % 2)) * 16
    tg_mem = (tg % 4) * KREP + tg // 4                # the step's group that tile group tg holds
    xk = gl.arange(0, BK, layout=gl.SliceLayout(1, B_OP))
    x_col = (((xk // 8) % 4) * KREP + xk // 32) * 8 + xk % 8
    x_col = gl.max_contiguous(gl.multiple_of(x_col, 8), 8)[:, None]
    xt = m0 + gl.arange(0, TOKENS, layout=gl.SliceLayout(0, B_OP))[None, :]
    x_ptrs = x_ptr + xt * stride_xm + g_begin * 8 + x_col
    x_tok_ok = xt < M

    acc = gl.zeros([BLOCK_N, TOKENS], gl.float32, MMA)
    for g0 in range(g_begin, g_end, BG):
        # next step's codes first: their HBM latency hides behind this step's lookups and MMAs
        c_ptrs += BG
        cw_next = gl.load(c_ptrs, mask=(g0 + BG + cg < g_end)[None, :], other=0)
        # tile order, byte offsets of both entries' copies in the SMEM codebooks
        pair = gl.reshape(gl.permute(gl.reshape(cw.to(gl.int32) & 0xFFFF, [BLOCK_N, 4, KREP]), [0, 2, 1]),
                          [BLOCK_N, BG])
        pair = gl.convert_layout(pair, L_TG)
        a0 = (pair & 0xFF) * (COPIES * 16) + copy_off
        a1 = (pair >> 8) * (COPIES * 16) + copy_off
        a0 = gl.convert_layout(gl.reshape(gl.broadcast(a0[:, :, None], gl.zeros([BLOCK_N, BG, 8], gl.int32, L3))[0],
                                          [BLOCK_N, BK]), A_OP)
        a1 = gl.convert_layout(gl.reshape(gl.broadcast(a1[:, :, None], gl.zeros([BLOCK_N, BG, 8], gl.int32, L3))[0],
                                          [BLOCK_N, BK]), A_OP)
        if dtype == gl.float16:
            w = gl.inline_asm_elementwise(DEQUANT_F16, DEQUANT_CON, [a0, a1], gl.float16,
                                          True, 8)
        else:
            w = gl.inline_asm_elementwise(DEQUANT_BF16, DEQUANT_CON, [a0, a1], gl.bfloat16,
                                          True, 8)
        if EVEN:
            xv = gl.load(x_ptrs, mask=x_tok_ok, other=0.0)
        else:
            k_ok = (g0 * 8 + x_col) < g_end * 8
            xv = gl.load(x_ptrs, mask=x_tok_ok & k_ok, other=0.0)
            w = gl.where(gl.convert_layout(gl.reshape(gl.broadcast((g0 + tg_mem < g_end)[:, :, None],
                                                                   gl.zeros([BLOCK_N, BG, 8], gl.int1, L3))[0],
                                                      [BLOCK_N, BK]), A_OP), w, gl.zeros_like(w))
        acc = mma_v2(w, xv, acc)
        x_ptrs += BK
        cw = cw_next
    cb_smem._keep_alive()   # the PTX lookups are invisible to the allocator: hold the copies to here

    # ---- stage 4: scale rows, combine split-K partials, bias, output ----
    rows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    toks = m0 + gl.arange(0, TOKENS, layout=gl.SliceLayout(0, MMA))
    scale = gl.load(scales_ptr + rows, mask=rows < N, other=0.0).to(gl.float32) * inverse
    _split_finish(acc * scale[:, None], rows, toks, M, N, out_ptr, ws_ptr, cnt_ptr, bias_ptr, stride_om, pid_n,
                  SPLIT_K, SPLIT, HAS_BIAS)
