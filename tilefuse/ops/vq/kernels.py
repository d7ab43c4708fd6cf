"""Triton (``tl``) kernels for the AQLM 2x8 VQ linear layer ``y = x @ W^T``.

``W[n, 8g:8g+8] = scale[n] * (C0[codes[n, g, 0]] + C1[codes[n, g, 1]])``.

* :func:`vq_decode_kernel` -- EVA's two stages in ONE launch, for 1-8 tokens. Each program owns
  ``BLOCK_N`` rows and a K range. Per K step it (1) builds the input x codebook table
  ``T_c[e, (m, g)] = <x[m, 8g:8g+8], C_c[e]>`` with one tensor-core dot ``[256, 16] x [16, COLS]``
  per codebook, and (2) looks up ``T_c[codes[n, g, c], (m, g)]`` for its ``BLOCK_N`` rows with
  ``tl.gather``, accumulating in fp32 registers. Split-K partials meet in an fp32 workspace
  (atomics); the last program of a row block (atomic counter) reads it back, scales, adds the bias,
  writes the output and leaves workspace and counter at zero for the next call (CUDA-graph safe,
  no zeroing launch). This is the CPU-tested reference implementation of the schedule; on the GPU
  Triton 3.6 lowers ``tl.gather`` to a warp-shuffle gather (its OptimizeThreadLocality pass forces
  a warp-local layout: 8 shuffles + 8 selects per lookup for a 256-entry table), so the fast
  kernel is the Gluon twin in ``kernels_gluon.py``, which pins the layouts so that the gather
  goes through shared memory without bank conflicts.
* :func:`vq_mma_kernel` -- 2 tokens and up: dequantize a ``[BLOCK_N, BLOCK_K]`` weight tile in
  registers (vectorized 16-byte gathers of codebook rows, which stay L1-resident: 2 x 4 KB) and
  feed ``tl.dot`` (tensor cores, x^T as the B operand) in the same kernel, split-K like the decode
  kernel. The CPU-tested twin of the Gluon ``kernels_mma.py`` kernel.

Token/group packing of the table columns (decode): the table has ``COLS`` columns; token ``m``
uses columns ``[m * GM, (m + 1) * GM)`` for the ``GM = COLS / M_PAD`` groups of the current K
step. Every column of a lookup tile then hits a different table column, which is what makes the
shared-memory lookups of the Gluon kernel conflict-free (bank = column).
"""

import triton
import triton.language as tl

from tilefuse.ops.tl_common import arrive


@triton.jit
def _splitk_epilogue(part, rows, toks, out_ptr, ws_ptr, cnt_ptr, bias_ptr, pid_n,
                     M, N, stride_om, SPLIT_K,
                     SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Combine ``part`` ([BLOCK_N, M_PAD] fp32, already scaled) into ``out`` ([M, N]).

    SPLIT (constexpr) False, i.e. SPLIT_K == 1: store directly. Otherwise fp32 atomics into ``ws`` ([M_max, N], zero between
    calls) and a per-row-block arrival counter; the last arriving program reads the sums back with
    an atomic add of 0 (a read at L2, where the atomics landed), writes the output, and resets
    workspace and counter to zero.
    """
    mask = (rows[:, None] < N) & (toks[None, :] < M)
    if not SPLIT:  # one program per row block: no workspace
        total = part
    else:
        ws_ptrs = ws_ptr + toks[None, :] * N + rows[:, None]
        tl.atomic_add(ws_ptrs, part, mask=mask, sem="relaxed")
        last = arrive(cnt_ptr + pid_n, 1, SPLIT_K)
        total = tl.zeros_like(part)
        if last:
            # read the sums where the atomics landed (L2), then leave zeros for the next call
            total = tl.atomic_add(ws_ptrs, tl.zeros_like(part), mask=mask, sem="relaxed")
            tl.store(ws_ptrs, tl.zeros_like(part), mask=mask)
            tl.store(cnt_ptr + pid_n, 0)
        mask = tl.where(last, mask, False)  # (not `mask & last`: Triton 3.9's interpreter makes that int32)
    if HAS_BIAS:
        total += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + toks[None, :] * stride_om + rows[:, None], total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def vq_decode_kernel(
    # pointers
    x_ptr, codes_ptr, cb_ptr, scales_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    # sizes
    M, N, NUM_GROUPS, GROUPS_PER_SPLIT, SPLIT_K,
    # strides (codes are read as int16 [N, NUM_GROUPS]: low byte = codebook 0, high byte = 1)
    stride_xm, stride_cn, stride_om,
    # meta-parameters
    BLOCK_N: tl.constexpr, COLS: tl.constexpr, M_PAD: tl.constexpr,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    GM: tl.constexpr = COLS // M_PAD  # groups per K step (per token)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    g_begin = pid_k * GROUPS_PER_SPLIT
    g_end = tl.minimum(g_begin + GROUPS_PER_SPLIT, NUM_GROUPS)

    # Stage 0 (HBM -> registers, once): A_c = codebook c as [256, 16], its 8 values on its own half
    # of k and zeros on the other (rounded to x's dtype: a tensor-core operand). B below holds x in
    # both halves, so a NaN in one codebook's entry never reaches the other codebook's table.
    offs_e = tl.arange(0, 256)
    offs_k = tl.arange(0, 16)
    a = tl.load(cb_ptr + (offs_k[None, :] // 8) * 2048 + offs_e[:, None] * 8 + (offs_k[None, :] % 8))
    a0 = tl.where(offs_k[None, :] < 8, a, 0.0).to(x_ptr.dtype.element_ty)
    a1 = tl.where(offs_k[None, :] >= 8, a, 0.0).to(x_ptr.dtype.element_ty)

    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, COLS)
    col_tok = cols // GM
    col_grp = cols % GM
    b_tok = col_tok[None, :]
    b_grp = col_grp[None, :]
    b_k = offs_k[:, None]
    acc = tl.zeros([BLOCK_N, COLS], dtype=tl.float32)
    for g0 in range(g_begin, g_end, GM):
        # Stage 1 (L2 -> registers): B[k, (m, g)] = x[m, 8(g0+g) + k % 8], both halves of k.
        grp = g0 + b_grp
        x_mask = (b_tok < M) & (grp < g_end)
        b = tl.load(x_ptr + b_tok * stride_xm + grp * 8 + (b_k % 8), mask=x_mask, other=0.0)
        # Stage 2 (tensor cores): the two tables, fp32, [256 entries, COLS].
        t0 = tl.dot(a0, b)
        t1 = tl.dot(a1, b)
        # Stage 3 (HBM -> registers): one int16 per (row, group) = both codes; masked groups read
        # code 0, whose table column is zero because x was masked to zero there.
        c_mask = (rows[:, None] < N) & ((g0 + col_grp[None, :]) < g_end)
        cv = tl.load(codes_ptr + rows[:, None] * stride_cn + (g0 + col_grp[None, :]), mask=c_mask, other=0)
        c0 = (cv & 0xFF).to(tl.int32)
        c1 = ((cv >> 8) & 0xFF).to(tl.int32)
        # Stage 4: lookups, T_c[code, col] for every (row, col); accumulate in fp32 registers.
        acc += tl.gather(t0, c0, 0) + tl.gather(t1, c1, 0)

    # Per-token sums over the token's GM columns, then the row scale (it factors out of the sum).
    scale = tl.load(scales_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    toks = tl.arange(0, M_PAD)
    part = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    for m in tl.static_range(M_PAD):
        s = tl.sum(tl.where(col_tok[None, :] == m, acc, 0.0), axis=1)
        part = tl.where(toks[None, :] == m, s[:, None], part)
    part = part * scale[:, None]
    _splitk_epilogue(part, rows, toks, out_ptr, ws_ptr, cnt_ptr, bias_ptr, pid_n, M, N, stride_om,
                     SPLIT_K, SPLIT, HAS_BIAS)


@triton.jit
def codebook_factor(cb_ptr, DTYPE: tl.constexpr):
    """Power-of-two factors ``(f, 1 / f)`` that keep every dequantized weight ``f (C0[a] + C1[b])``
    finite in x's dtype ``DTYPE`` (fp16 or bf16; largest finite value LIMIT): ``f = 1`` unless
    twice the codebooks' largest finite magnitude exceeds LIMIT (fp16 codebooks with entries above
    32752; fp32 ones beyond x's range), then the largest power of two with ``2 max |C| f <= LIMIT``.
    Exact: scaling by a power of two changes no rounding (short of subnormals), and ``1 / f`` goes
    into the row scale. Non-finite entries are left out (they give inf / NaN where used, as in the
    reference). ``kernels_mma.codebook_factor`` is the Gluon twin."""
    # 2^SHIFT * 2 / LIMIT, SHIFT keeping it a normal fp32 number (2 / bf16's max is subnormal)
    RATIO: tl.constexpr = 2.0 / 65504.0 if DTYPE == tl.float16 else 2.0 ** 32 * 2.0 / 3.3895313892515355e38
    SHIFT: tl.constexpr = 0 if DTYPE == tl.float16 else 32
    v = tl.abs(tl.load(cb_ptr + tl.arange(0, 4096)).to(tl.float32))
    big = tl.max(tl.where(v < float("inf"), v, 0.0), axis=0)
    # the smallest e >= 0 with 2 big 2^-e <= LIMIT: the exponent of 2 big / LIMIT rounded up (bits)
    r = (big * RATIO).to(tl.int32, bitcast=True)
    e = ((r >> 23) & 0xFF) - (127 + SHIFT) + ((r & 0x7FFFFF) != 0).to(tl.int32)
    e = tl.minimum(tl.maximum(e, 0), 126)
    return ((127 - e) << 23).to(tl.float32, bitcast=True), ((127 + e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mma_steps(acc, c_ptrs, x_ptrs, cb_ptr, toks, M, g_begin, g_end, factor,
               BG: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr):
    """The MMA kernel's K loop: ``acc += W'`` tiles x x^T, with ``W' = C0[a] + C1[b]`` (``SCALED``:
    times ``factor``, before the rounding to x's dtype)."""
    dtype = x_ptrs.dtype.element_ty
    offs_g = tl.arange(0, BG)
    offs_k = tl.arange(0, BLOCK_K)
    offs_j = tl.arange(0, 8)
    for g0 in range(g_begin, g_end, BG):
        # codes [BLOCK_N, BG] int16 (HBM -> registers); groups past g_end read code 0
        g_ok = (g0 + offs_g) < g_end
        cv = tl.load(c_ptrs, mask=g_ok[None, :], other=0)
        c0 = (cv & 0xFF).to(tl.int32) * 8               # multiples of 8 elements: 16-byte rows
        c1 = ((cv >> 8) & 0xFF).to(tl.int32) * 8 + 2048
        o0 = tl.max_contiguous(tl.multiple_of(c0[:, :, None] + offs_j[None, None, :], [1, 1, 8]), [1, 1, 8])
        o1 = tl.max_contiguous(tl.multiple_of(c1[:, :, None] + offs_j[None, None, :], [1, 1, 8]), [1, 1, 8])
        # dequantize (L1-resident codebook rows -> registers): one rounding to x's dtype; groups
        # past g_end are zeroed (an entry 0 of inf / NaN must not meet x's zeros there)
        e0 = tl.load(cb_ptr + o0).to(tl.float32)
        e1 = tl.load(cb_ptr + o1).to(tl.float32)
        if SCALED:
            w = (e0 * factor + e1 * factor).to(dtype)
        else:
            w = (e0 + e1).to(dtype)
        w = tl.where(g_ok[None, :, None], w, 0.0)
        w = tl.reshape(w, (acc.shape[0], BLOCK_K))
        # x^T [BLOCK_K, TOKENS] (L2 -> registers); tokens past M and inputs past g_end read zero
        xv = tl.load(x_ptrs, mask=(toks[None, :] < M) & ((g0 * 8 + offs_k) < g_end * 8)[:, None], other=0.0)
        acc = tl.dot(w, xv, acc)
        c_ptrs += BG
        x_ptrs += BLOCK_K
    return acc


@triton.jit
def vq_mma_kernel(
    # pointers (codes read as int16 [N, NUM_GROUPS]: low byte codebook 0, high byte codebook 1)
    x_ptr, codes_ptr, cb_ptr, scales_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    # sizes
    M, N, NUM_GROUPS, GROUPS_PER_SPLIT, SPLIT_K,
    # strides
    stride_xm, stride_cn, stride_om,
    # meta-parameters
    BLOCK_N: tl.constexpr, TOKENS: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """Dequantize ``[BLOCK_N, BLOCK_K]`` weight tiles in registers and multiply them with x^T
    (``[BLOCK_K, TOKENS]``) on tensor cores (swap-AB: rows are the MMA's M, tokens its N); split-K
    over the grid's axis 1, token tiles over axis 2 (then SPLIT is False).

    The ``tl`` twin of ``kernels_mma.vq_decode_mma_kernel`` (same arithmetic: each weight
    ``f (C0[a] + C1[b])`` rounded once to x's dtype, fp32 accumulation, the row scale times ``1 / f``
    applied to the sums; ``f`` from :func:`codebook_factor`, 1 unless the codebooks' sums could
    overflow x's dtype), the one the CPU tests run; on the GPU the codebook rows are gathered
    through L1 instead of the Gluon kernel's conflict-free shared-memory copies. Also the fused
    prefill variant."""
    BG: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    toks = tl.program_id(2) * TOKENS + tl.arange(0, TOKENS)
    g_begin = pid_k * GROUPS_PER_SPLIT
    g_end = tl.minimum(g_begin + GROUPS_PER_SPLIT, NUM_GROUPS)

    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, BG)
    offs_k = tl.arange(0, BLOCK_K)
    # rows past N are clamped to N - 1 (loads stay in bounds; those rows are never stored)
    c_ptrs = codes_ptr + tl.minimum(rows, N - 1)[:, None] * stride_cn + g_begin + offs_g[None, :]
    x_ptrs = x_ptr + toks[None, :] * stride_xm + g_begin * 8 + offs_k[:, None]
    acc = tl.zeros([BLOCK_N, TOKENS], dtype=tl.float32)
    # C0[a] + C1[b] must be finite in x's dtype (the MMA operand) even where the scaled weight
    # would be: codebooks that could overflow are scaled by a power of two f < 1 and the row scale
    # by 1 / f. The common case (f = 1) runs the loop without the multiply: no instruction per
    # weight is added there, only this one look at the codebooks per program.
    factor, inverse = codebook_factor(cb_ptr, x_ptr.dtype.element_ty)
    if factor == 1.0:
        acc = _mma_steps(acc, c_ptrs, x_ptrs, cb_ptr, toks, M, g_begin, g_end, factor, BG, BLOCK_K, False)
    else:
        acc = _mma_steps(acc, c_ptrs, x_ptrs, cb_ptr, toks, M, g_begin, g_end, factor, BG, BLOCK_K, True)

    scale = tl.load(scales_ptr + rows, mask=rows < N, other=0.0).to(tl.float32) * inverse
    _splitk_epilogue(acc * scale[:, None], rows, toks, out_ptr, ws_ptr, cnt_ptr, bias_ptr, pid_n, M, N, stride_om,
                     SPLIT_K, SPLIT, HAS_BIAS)


@triton.jit
def dequant_tile(codes_ptr, cb_ptr, scales_ptr, w_ptr, N, NUM_GROUPS, stride_cn, stride_wn, pid_n, pid_g,
                 BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    """``W[n, 8g:8g+8] = scale[n] * (C0[c0] + C1[c1])`` for the [BLOCK_N, 8 * BLOCK_G] tile
    (``pid_n``, ``pid_g``) of one weight: codes uint8 [N, K/8, 2] (row stride ``stride_cn``),
    codebooks [2, 256, 8], scales [N], W [N, K] (row stride ``stride_wn``)."""
    # tiles are [BLOCK_G, BLOCK_N, 8] with groups before rows, so that a warp's lanes walk along
    # a row: 16-byte weight stores and 2-byte code loads of consecutive lanes are adjacent
    offs_g = pid_g * BLOCK_G + tl.arange(0, BLOCK_G)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, 8)
    ok = (offs_g[:, None] < NUM_GROUPS) & (offs_n[None, :] < N)
    c_ptrs = codes_ptr + offs_n[None, :] * stride_cn + offs_g[:, None] * 2
    c0 = tl.load(c_ptrs, mask=ok, other=0).to(tl.int32)
    c1 = tl.load(c_ptrs + 1, mask=ok, other=0).to(tl.int32)
    w = tl.load(cb_ptr + (c0 * 8)[:, :, None] + offs_j[None, None, :]).to(tl.float32)
    w += tl.load(cb_ptr + (c1 * 8 + 2048)[:, :, None] + offs_j[None, None, :]).to(tl.float32)
    scale = tl.load(scales_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    w = w * scale[None, :, None]
    w_ptrs = w_ptr + offs_n[None, :, None] * stride_wn + offs_g[:, None, None] * 8 + offs_j[None, None, :]
    tl.store(w_ptrs, w.to(w_ptr.dtype.element_ty), mask=ok[:, :, None])


@triton.jit
def vq_dequant_kernel(
    # pointers
    codes_ptr, cb_ptr, scales_ptr, w_ptr,
    # sizes
    N, NUM_GROUPS,
    # strides (codes are read as uint8 [N, K/8, 2]; w is [N, K])
    stride_cn, stride_wn,
    # meta-parameters
    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
):
    """``W[n, 8g:8g+8] = scale[n] * (C0[c0] + C1[c1])`` for a [BLOCK_N, 8 * BLOCK_G] tile.

    Streams the codes once (HBM), gathers 16-byte codebook rows (L1-resident: 2 x 4 KB), sums in
    fp32 and writes the weight tile once in w's dtype (one rounding per weight). The prefill path
    then runs cuBLAS on it (what AQLM does for prefill), see ``op.launch_dequant``.
    """
    dequant_tile(codes_ptr, cb_ptr, scales_ptr, w_ptr, N, NUM_GROUPS, stride_cn, stride_wn, tl.program_id(0),
                 tl.program_id(1), BLOCK_N, BLOCK_G)
