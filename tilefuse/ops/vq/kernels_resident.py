"""Gluon decode kernel with a shared-memory-resident lookup table (GPU only, sm_80+).

EVA's decode in one launch, the table built ONCE per program and reused for every row it owns:

* grid = (row chunks, K slices). A K slice is ``G = 64 / M_PAD`` groups of 8 inputs, so the
  table ``T[cb, c, rho] = <C_cb[c], x[m, 8g:8g+8]>`` for both codebooks, 256 codes and
  ``64 = G * M_PAD`` (group, token) columns is 2 x 256 x 64 fp32 = 128 KB of shared memory
  (one CTA per SM).
* Stage 0 (HBM -> registers): the first two blocks of code words are requested before the table
  is built, so their latency overlaps it. Codes are read as int32 words, one per lane: bytes
  c0(2w), c1(2w), c0(2w+1), c1(2w+1) of groups 2w and 2w+1. Row and word indices past the end are
  clamped instead of masked (no predicates in the stream; see ``_load_words``).
* Stage 1 (HBM -> SMEM -> registers -> SMEM, once): x of the slice, and both codebooks staged in
  16 KB of shared memory, give the table by CUDA-core FMAs (262 K per program), computed in a
  layout whose lanes run along ``rho`` so every store is bank-conflict free; one CTA barrier.
* Stage 2 (streamed): per block of ``BLOCK_R`` rows, the block ``AHEAD`` ahead is requested, then every
  code byte is looked up by inline PTX: one ``prmt`` builds ``c * 256 B + rho * 4 B`` and one
  ``ld.shared`` reads ``table + cb * 64 KB + that`` (about 32 SASS per row and warp in all for one
  token). ``rho`` is laid out so that the lanes of each (quarter/half) warp read distinct banks
  whatever the codes are (EVA's conflict-free table).
* Stage 3: per-row sums over the warp (one token: a transposed butterfly over the thread's rows
  that ends in one ``red.global.add`` per row, ``ptx.reduce_emit_asm``; several tokens: a
  butterfly per row); split-K partials meet in an fp32 workspace; the last program of a row chunk (arrival
  counter) applies the row scale (it factors out of the sum, so it stays out of the loop), adds the
  bias, writes the output and re-zeroes workspace and counter (no zeroing launch, CUDA-graph safe).

Why inline PTX: Gluon 3.6 has no indexed shared-memory load; ``gl.gather`` copies its register
source to shared memory on every call, which made the table traffic 3x the lookup traffic. The
PTX addresses ``global_smem`` (Triton's dynamic shared memory symbol) directly; the table is the
kernel's largest allocation and Triton's allocator places it at offset 0 (checked in the LLVM IR
with tilefuse.testing.gluon; the GPU tests would see any other placement as wrong results). ``table._keep_alive()`` after the loop keeps the allocator from
reusing the table's bytes while the (to it invisible) PTX lookups still read them.

Column order for (group g = 2w + j of the slice, token m): ``rho = j * 32 + w * M_PAD + m``. The
lane owning word w reads its M_PAD tokens' entries of one (code, group) as one
``ld.shared.v{M_PAD}``; for fixed j the lanes of a wavefront cover 32 consecutive words.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tilefuse.ops.gluon_compat import smem_reinterpret, thread_barrier

from tilefuse.ops.vq.ptx import lookup_asm, reduce_emit_asm

TABLE_COLS = gl.constexpr(64)  # (group, token) columns per K slice: 256 B per table row

LOOKUP_ASM_1 = gl.constexpr(lookup_asm(1))
LOOKUP_ASM_2 = gl.constexpr(lookup_asm(2))
LOOKUP_ASM_4 = gl.constexpr(lookup_asm(4))
REDUCE_ASM_2, REDUCE_CON_2 = (gl.constexpr(t) for t in reduce_emit_asm(2))
REDUCE_ASM_4, REDUCE_CON_4 = (gl.constexpr(t) for t in reduce_emit_asm(4))
REDUCE_ASM_8, REDUCE_CON_8 = (gl.constexpr(t) for t in reduce_emit_asm(8))


@gluon.jit
def _load_words(codes_ptr, r0, r_tile, col, N, stride_cw):
    """Code words of rows ``r0 + r_tile`` ([BLOCK_R, W], int32). Rows past N are clamped to N - 1
    (``col`` is clamped by the caller) instead of masked: every load is in bounds and needs no
    predicate, and what those lanes look up is never emitted or lands in zero table columns."""
    rows = gl.minimum(r0 + r_tile, N - 1)
    return gl.load(codes_ptr + rows * stride_cw + col)


@gluon.jit
def _emit_split_1tok(v, rows, r_end, ws_ptr, word, RPT: gl.constexpr):
    """Split-K, one token: the row sums of ``v`` [BLOCK_R, 32] go to the workspace by the transposed
    butterfly + one atomic per row (``ptx.reduce_emit_asm``); RPT = rows per thread."""
    ws_ptrs = (ws_ptr + (rows[:, None] + word[None, :] * 0)).to(gl.int64, bitcast=True)
    valid = ((rows < r_end)[:, None] & (word >= 0)[None, :]).to(gl.int32)
    if RPT == 2:
        gl.inline_asm_elementwise(REDUCE_ASM_2, REDUCE_CON_2, [v, ws_ptrs, valid], gl.int32, False, 2)
    elif RPT == 4:
        gl.inline_asm_elementwise(REDUCE_ASM_4, REDUCE_CON_4, [v, ws_ptrs, valid], gl.int32, False, 4)
    else:
        gl.inline_asm_elementwise(REDUCE_ASM_8, REDUCE_CON_8, [v, ws_ptrs, valid], gl.int32, False, 8)


@gluon.jit
def _emit(v, m, rows, r_end, M, out_ptr, ws_ptr, stride_om, scales_ptr, bias_ptr, N,
          SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr):
    """Token ``m``'s row sums of one K slice (a warp butterfly per row over ``v`` [BLOCK_R, W]; the
    result stays replicated over the row's lanes: no layout change, so no CTA barrier per block).
    Split-K: unscaled fp32 atomics into the workspace (the row scale is applied once, by the last
    program); else scaled (+ bias) straight to the output. Rows past the chunk are never emitted."""
    part = gl.sum(v, axis=1)
    ok = (rows < r_end) & (m < M)
    if SPLIT:
        gl.atomic_add(ws_ptr + m * N + rows, part, mask=ok, sem="relaxed")
    else:
        part = part * gl.load(scales_ptr + rows, mask=ok, other=0.0).to(gl.float32)
        if HAS_BIAS:
            part += gl.load(bias_ptr + rows, mask=ok, other=0.0).to(gl.float32)
        gl.store(out_ptr + m * stride_om + rows, part.to(out_ptr.dtype.element_ty), mask=ok)


@gluon.jit
def vq_decode_resident_kernel(
    # pointers
    x_ptr, codes_ptr, cb_ptr, scales_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    # sizes (codes read as int32 words [N, NUM_GROUPS / 2]: bytes c0(2w), c1(2w), c0(2w+1), c1(2w+1))
    M, N, NUM_GROUPS, ROWS_PER_PROG, SPLIT_K,
    # strides (stride_cw: code words per row)
    stride_xm, stride_cw, stride_om,
    # meta-parameters
    M_PAD: gl.constexpr, BLOCK_R: gl.constexpr, AHEAD: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr,
    NUM_WARPS: gl.constexpr,
):
    G: gl.constexpr = TABLE_COLS // M_PAD            # groups per K slice
    W: gl.constexpr = G // 2                         # code words per row and slice (one per lane)
    CH: gl.constexpr = 32                            # table rows built per step
    RPT: gl.constexpr = BLOCK_R // NUM_WARPS         # rows per thread and block (one token: W = 32)
    FAST_REDUCE: gl.constexpr = M_PAD == 1 and (RPT == 2 or RPT == 4 or RPT == 8)
    # stage 1 layouts: [CH table rows (cb, c), 8 k, 64 rho]; lanes along rho, k inside a thread
    L3: gl.constexpr = gl.BlockedLayout([1, 8, 2], [1, 1, 32], [NUM_WARPS, 1, 1], [2, 1, 0])
    L_CB: gl.constexpr = gl.SliceLayout(2, L3)       # codebook rows [CH, 8]
    L_XT: gl.constexpr = gl.SliceLayout(0, L3)       # x of the slice [8, 64]
    L_CBALL: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32, 1], [NUM_WARPS, 1, 1], [2, 1, 0])
    # stage 2 layout: code words [BLOCK_R, W], lane = word (W lanes per row)
    L_CODE: gl.constexpr = gl.BlockedLayout([1, 1], [32 // W, W], [NUM_WARPS, 1], [1, 0])
    TABLE: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])   # row-major, no swizzle
    FLAT3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])

    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    g0 = pid_k * G
    table = gl.allocate_shared_memory(gl.float32, [2 * 256 // CH, CH, TABLE_COLS], TABLE)
    cb_smem = gl.allocate_shared_memory(gl.float32, [2 * 256 // CH, CH, 8], FLAT3)

    # ---- stage 0: the first AHEAD (2-4) blocks of code words are requested now, so that their HBM
    # latency overlaps the table build (codes [N, NUM_GROUPS/2] int32 -> registers, lane = word) ----
    # words past the last group are clamped to it: their lanes look up zero table columns (x masked)
    word = gl.arange(0, W, layout=gl.SliceLayout(0, L_CODE))
    col = gl.minimum(g0 // 2 + word, NUM_GROUPS // 2 - 1)[None, :]
    r_tile = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, L_CODE))[:, None]
    r_begin = pid_n * ROWS_PER_PROG
    r_end = gl.minimum(r_begin + ROWS_PER_PROG, N)
    words = _load_words(codes_ptr, r_begin, r_tile, col, N, stride_cw)
    words_next = _load_words(codes_ptr, r_begin + BLOCK_R, r_tile, col, N, stride_cw)
    words_next2 = words_next            # blocks 2 and 3 ahead: loaded only when AHEAD reaches them
    words_next3 = words_next
    if AHEAD >= 3:
        words_next2 = _load_words(codes_ptr, r_begin + 2 * BLOCK_R, r_tile, col, N, stride_cw)
    if AHEAD >= 4:
        words_next3 = _load_words(codes_ptr, r_begin + 3 * BLOCK_R, r_tile, col, N, stride_cw)

    # ---- stage 1: x slice (HBM -> registers, once) and the table (registers -> SMEM) ----
    # column rho holds (group 2w + j, token m) with j = rho // 32, w = rho % 32 // M_PAD
    rho = gl.arange(0, TABLE_COLS, layout=gl.SliceLayout(0, L_XT))[None, :]
    kx = gl.arange(0, 8, layout=gl.SliceLayout(1, L_XT))[:, None]
    grp = g0 + 2 * ((rho % 32) // M_PAD) + rho // 32
    tok = rho % M_PAD
    xt = gl.load(x_ptr + tok * stride_xm + grp * 8 + kx, mask=(tok < M) & (grp < NUM_GROUPS), other=0.0)
    xt = xt.to(gl.float32)[None, :, :]
    # both codebooks [C0; C1] ([512, 8], 8 KB) in one wave of 16-byte loads (HBM/L2 -> SMEM), so
    # the build loop below reads them at shared-memory latency; kept at their own precision (fp32
    # math), as the spec computes
    cb_s = gl.arange(0, 2 * 256 // CH, layout=gl.SliceLayout(1, gl.SliceLayout(2, L_CBALL)))[:, None, None]
    cb_r = gl.arange(0, CH, layout=gl.SliceLayout(0, gl.SliceLayout(2, L_CBALL)))[None, :, None]
    cb_k = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L_CBALL)))[None, None, :]
    cb_smem.store(gl.load(cb_ptr + (cb_s * CH + cb_r) * 8 + cb_k).to(gl.float32))
    thread_barrier()
    cb_steps = smem_reinterpret(cb_smem, gl.float32, [2 * 256 // CH, CH, 8], TABLE)  # same bytes, indexable
    for step in range(2 * 256 // CH):
        cbv = cb_steps.index(step).load(L_CB)
        table.index(step).store(gl.sum(cbv[:, :, None] * xt, axis=1))
    thread_barrier()
    cb_smem._keep_alive()

    # ---- stage 2: stream code words (HBM -> registers), look up (SMEM -> registers) ----
    word_col = (word * (4 * M_PAD))[None, :]   # byte offset of the word's first column, < 256
    r_out = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, L_CODE))
    for r0 in range(r_begin, r_end, BLOCK_R):
        # AHEAD blocks of codes stay in flight (HBM latency x bandwidth per SM: ~32-64 KB, a block of
        # 128 rows is 16 KB at one token)
        words_far = _load_words(codes_ptr, r0 + AHEAD * BLOCK_R, r_tile, col, N, stride_cw)
        rows = r0 + r_out
        if M_PAD == 1:
            v = gl.inline_asm_elementwise(LOOKUP_ASM_1, "=f,r,r", [words, word_col], gl.float32, False, 1)
            if SPLIT and FAST_REDUCE:
                _emit_split_1tok(v, rows, r_end, ws_ptr, word, RPT)
            else:
                _emit(v, 0, rows, r_end, M, out_ptr, ws_ptr, stride_om, scales_ptr, bias_ptr, N, SPLIT, HAS_BIAS)
        elif M_PAD == 2:
            v0, v1 = gl.inline_asm_elementwise(LOOKUP_ASM_2, "=f,=f,r,r", [words, word_col],
                                               (gl.float32, gl.float32), False, 1)
            _emit(v0, 0, rows, r_end, M, out_ptr, ws_ptr, stride_om, scales_ptr, bias_ptr, N, SPLIT, HAS_BIAS)
            _emit(v1, 1, rows, r_end, M, out_ptr, ws_ptr, stride_om, scales_ptr, bias_ptr, N, SPLIT, HAS_BIAS)
        else:
            v0, v1, v2, v3 = gl.inline_asm_elementwise(LOOKUP_ASM_4, "=f,=f,=f,=f,r,r", [words, word_col],
                                                       (gl.float32, gl.float32, gl.float32, gl.float32), False, 1)
            _emit(v0, 0, rows, r_end, M, out_ptr, ws_ptr, stride_om, scales_ptr, bias_ptr, N, SPLIT, HAS_BIAS)
            _emit(v1, 1, rows, r_end, M, out_ptr, ws_ptr, stride_om, scales_ptr, bias_ptr, N, SPLIT, HAS_BIAS)
            _emit(v2, 2, rows, r_end, M, out_ptr, ws_ptr, stride_om, scales_ptr, bias_ptr, N, SPLIT, HAS_BIAS)
            _emit(v3, 3, rows, r_end, M, out_ptr, ws_ptr, stride_om, scales_ptr, bias_ptr, N, SPLIT, HAS_BIAS)
        # shift the blocks in flight down by one; the far load joins at depth AHEAD - 1
        words = words_next
        if AHEAD == 2:
            words_next = words_far
        elif AHEAD == 3:
            words_next = words_next2
            words_next2 = words_far
        else:
            words_next = words_next2
            words_next2 = words_next3
            words_next3 = words_far
    table._keep_alive()  # the PTX lookups are invisible to the allocator: hold the table to here

    # ---- stage 3 (split-K): the last program of this row chunk finishes its rows ----
    if SPLIT:
        thread_barrier()  # every thread's atomics are issued before the arrival (release)
        arrived = gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            # wide blocks (8 rows per thread): the L2 round trips of a chunk overlap
            L_FIN: gl.constexpr = gl.BlockedLayout([8], [32], [NUM_WARPS], [0])
            BLOCK_F: gl.constexpr = 8 * 32 * NUM_WARPS
            for r0 in range(r_begin, r_end, BLOCK_F):
                rows = r0 + gl.arange(0, BLOCK_F, layout=L_FIN)
                zero = gl.zeros([BLOCK_F], gl.float32, L_FIN)
                fin_scale = gl.load(scales_ptr + rows, mask=rows < r_end, other=0.0).to(gl.float32)
                fin_bias = zero
                if HAS_BIAS:
                    fin_bias = gl.load(bias_ptr + rows, mask=rows < r_end, other=0.0).to(gl.float32)
                for m in gl.static_range(M_PAD):
                    ok = (rows < r_end) & (m < M)
                    # read the sums where the atomics landed (L2), leave zeros for the next call
                    total = gl.atomic_add(ws_ptr + m * N + rows, zero, mask=ok, sem="relaxed")
                    gl.store(ws_ptr + m * N + rows, zero, mask=ok)
                    result = total * fin_scale + fin_bias
                    gl.store(out_ptr + m * stride_om + rows, result.to(out_ptr.dtype.element_ty), mask=ok)
            gl.store(cnt_ptr + pid_n, 0)
