"""Gluon sparse (top-k) MLA decode over an FP8 latent cache for Hopper, few heads per KV head:
gathered cache rows through a cp.async ring, transposed WGMMAs (paper 3's orientation).

The ``tl`` gather kernel (``kernels.mla_sparse_split_kernel``) loads each gathered row into
registers and waits for it: with 255 registers per thread, two programs per SM and nothing else in
flight it reads DRAM at 14 % of its peak. Here the rows of the next ``STAGES - 1`` tiles are in
flight while the tensor cores work on the current one, and registers hold only the accumulator:

* **Gather** (HBM -> SMEM, cp.async): a tile is 64 index-list positions; each names one 656-byte
  cache row (512 e4m3 codes, 4 fp32 scales, 64 bf16 RoPE values), copied as three parts (codes,
  scales, RoPE) into ring slot ``tile % STAGES``, one cp.async group per tile. Hopper's TMA has no
  row gather; cp.async moves 16 (scales: 8) bytes per thread per copy. A position that names no
  token (-1, outside the cache, past ``topk_length``) copies nothing and lands as zeros. The
  part's index list is copied into SMEM once at the start, so no gather waits on an index load.
* **Dequantize** (SMEM -> registers -> SMEM): the slot's codes times their group's scale, rounded
  once to bf16 (``mla_dequantize_kv``'s values), and the RoPE part, into one bf16 K tile in
  WGMMA's swizzled layout; the slot is then free for the copy of a later tile.
* **Transposed products** (cached tokens as WGMMA's M = 64, the BLOCK_H heads as N, nothing padded
  to 64 heads): ``S^T = K Q^T`` ([64, BLOCK_H], Q resident in SMEM), the online softmax down the
  token axis, ``O^T = V^T P^T`` ([512, BLOCK_H] fp32: 64 registers per thread at 16 heads) with
  ``V^T`` the K tile's first 512 columns read transposed and ``P^T`` through SMEM. At 16 heads a
  padded head tile would do 4x the work and turn the FP8 read compute-bound (64 x 2176 FLOP per
  656-byte token is 212 FLOP/B, above the H200's ridge); transposed, the MMAs read each K tile
  from SMEM twice and do 16 / 64 of the padded FLOPs.

One program per (part of the index list, query token, head tile) and per SM (the SMEM it holds),
4 warps, or 8 with the two warpgroups splitting the tile's heads; the partials and
``kernels.mla_sparse_combine_kernel`` (sink, several parts, a second cache) are the ``tl`` path's.
Measured, and why it stops where it does: docs/mla.md ("Sparse decode on Hopper").
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tilefuse.ops.gluon_compat import (cp_async, cp_commit, cp_wait, fence_async_shared, smem_reinterpret,
                                       thread_barrier, warpgroup_mma, warpgroup_mma_wait)
from tilefuse.ops.mla.reference import FP8_KV_BYTES, HEAD_DIM, HEAD_DIM_V

D_NOPE = gl.constexpr(HEAD_DIM_V)
D_ROPE = gl.constexpr(HEAD_DIM - HEAD_DIM_V)
BLOCK_N = gl.constexpr(64)                       # gathered tokens per tile: WGMMA's M
ROW_WORDS = gl.constexpr(FP8_KV_BYTES // 4)      # one cached token, in 4-byte words (164)
CODE_WORDS = gl.constexpr(HEAD_DIM_V // 4)       # its 512 e4m3 codes (128 words)
SCALE_WORDS = gl.constexpr(4)                    # then 4 fp32 scales, one per 128 codes
ROPE_WORDS = gl.constexpr(D_ROPE // 2)           # then 64 bf16 RoPE values (32 words)
GROUP = gl.constexpr(128)                        # codes per scale
CHUNKS = gl.constexpr(8)                         # S^T's 512-wide part as 8 WGMMAs of K = 64

# Shared layouts of a ring slot: each 16-byte vector of a row XOR-swizzled by the row (mod 8), so
# that the gather's writes (4 rows x 128 bytes per warp) and the dequantization's reads (8 rows x 64
# bytes) spread over all banks instead of hitting the same ones at a 512-byte row stride. The same
# bytes viewed as words (vectors of 4) and as e4m3 codes (vectors of 16).
WORDS_SMEM = gl.constexpr(gl.SwizzledSharedLayout(4, 1, 8, [1, 0]))
CODES_SMEM = gl.constexpr(gl.SwizzledSharedLayout(16, 1, 8, [1, 0]))
FLAT = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
FLAT1 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))


@gluon.constexpr_function
def _rows_layout(cols_per_thread, threads_per_row, num_warps):
    """Rows over lanes and warps, ``cols_per_thread`` contiguous elements per thread."""
    return gl.BlockedLayout([1, cols_per_thread], [32 // threads_per_row, threads_per_row], [num_warps, 1], [1, 0])


@gluon.jit
def _tile_rows(idx_list, t, n, num_tokens, ROWS: gl.constexpr):
    """Tile t of the part's index list (in SMEM, ``n`` positions valid) -> (which of its 64 rows
    name a cached token, their row indices or 0), in layout ``ROWS``."""
    pos = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=ROWS)
    idx = idx_list.index(gl.minimum(t, idx_list.shape[0] - 1)).load(ROWS)     # past the end: masked by n
    ok = (pos < n) & (idx >= 0) & (idx < num_tokens)
    return ok, gl.where(ok, idx, 0).to(gl.int64)


@gluon.jit
def _gather(kc_ptr, idx_list, t, n, num_tokens, codes, scales, rope, WORDS_L: gl.constexpr, SCALES_L: gl.constexpr):
    """HBM -> SMEM (cp.async, not waited for): the cache rows named by tile t of the index list
    into one ring slot; rows that name no token copy nothing (zeros land)."""
    ok, slot = _tile_rows(idx_list, t, n, num_tokens, gl.SliceLayout(1, WORDS_L))
    row = kc_ptr + slot * ROW_WORDS
    words = gl.arange(0, CODE_WORDS, layout=gl.SliceLayout(0, WORDS_L))
    cp_async(codes, row[:, None] + words[None, :], mask=ok[:, None])
    rope_words = gl.arange(0, ROPE_WORDS, layout=gl.SliceLayout(0, WORDS_L))
    cp_async(rope, row[:, None] + (CODE_WORDS + SCALE_WORDS) + rope_words[None, :], mask=ok[:, None])
    ok_s, slot_s = _tile_rows(idx_list, t, n, num_tokens, gl.SliceLayout(1, SCALES_L))
    scale_words = gl.arange(0, SCALE_WORDS, layout=gl.SliceLayout(0, SCALES_L))
    cp_async(scales, (kc_ptr + slot_s * ROW_WORDS + CODE_WORDS)[:, None] + scale_words[None, :], mask=ok_s[:, None])


@gluon.jit
def _dequantize(codes, scales, rope, k_nope, k_rope, dtype: gl.constexpr, CODES_L: gl.constexpr,
                HALF_L: gl.constexpr):
    """SMEM -> registers -> SMEM: a slot's e4m3 codes x their group's scale, rounded once to
    ``dtype`` (``mla_dequantize_kv``'s values), and its RoPE part into the 16-bit K tile (WGMMA's
    layout), 64 columns at a time."""
    codes8 = smem_reinterpret(codes, gl.float8e4nv, [BLOCK_N, D_NOPE], CODES_SMEM)
    scale32 = smem_reinterpret(scales, gl.float32, [BLOCK_N, SCALE_WORDS], FLAT)
    for c in gl.static_range(D_NOPE // 64):
        scale = scale32.slice((c * 64) // GROUP, 1, dim=1).load(CODES_L)                 # [64, 1]
        v = codes8.slice(c * 64, 64, dim=1).load(CODES_L).to(gl.float32) * scale
        k_nope.slice(c * 64, 64, dim=1).store(v.to(dtype))
    k_rope.store(smem_reinterpret(rope, dtype, [BLOCK_N, D_ROPE], FLAT).load(HALF_L))


@gluon.jit
def _softmax_pv_transposed(s, keep, qk_scale, m_i, l_i, acc, k_nope, p_t):
    """One tile of the transposed decode after ``S^T`` ([64 tokens, heads] fp32, waited for):
    scores where ``keep`` (else -inf: a NaN there is never selected), the online softmax down the
    token axis (running max ``m_i`` and sum ``l_i`` per head), then ``O^T = O^T alpha + V^T P^T``
    on the tensor cores with V^T the K tile ``k_nope`` read transposed and P^T through ``p_t``
    (SMEM, K's dtype). Returns the new ``(m_i, l_i, acc)``."""
    s = gl.where(keep, s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - m_safe[None, :])
    l_i = l_i * alpha + gl.sum(p, axis=0)
    p_t.store(gl.permute(p.to(p_t.dtype), (1, 0)))
    fence_async_shared()
    thread_barrier()
    acc = warpgroup_mma(k_nope.permute((1, 0)), p_t.permute((1, 0)), acc * alpha[None, :], is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    return m_new, l_i, acc


@gluon.jit
def mla_sparse_gluon_kernel(
    q_ptr, kc_ptr, idx_ptr, len_ptr, oacc_ptr, lseacc_ptr,
    h_q, s_q, topk, num_tokens, chunk_base, num_chunks, qk_scale,
    stride_qb, stride_qs, stride_qh, stride_ib, stride_is,
    BLOCK_H: gl.constexpr, CHUNK: gl.constexpr, IDX_TILES: gl.constexpr, HAS_LEN: gl.constexpr,
    STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
):
    """Sparse decode over an FP8 cache (``kc_ptr``: the contiguous cache as int32 words, 164 per
    token), one part: the BLOCK_H heads of tile ``pid 2`` of one query token (``pid 1`` = request x
    s_q + token) over positions ``pid 0 x CHUNK ..`` of its index list, written as a normalised
    partial and its log2-sum-exp at ``chunk_base + pid 0`` (``mla_sparse_combine_kernel`` merges
    them). The arguments and partials are ``kernels.mla_sparse_split_kernel``'s."""
    chunk = gl.program_id(0)
    unit = gl.program_id(1)
    pid_h = gl.program_id(2)
    req = unit // s_q
    tok = unit % s_q
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    # Register layouts: the gather's pointer tensors (16- and 8- or 4-byte vectors per thread), the
    # dequantization (16 codes per thread), the bf16 copies (8 values per thread), the index copy;
    # the WGMMA accumulators of S^T and O^T (8 warps: each warpgroup half of the heads).
    WORDS_L: gl.constexpr = _rows_layout(4, 8, NUM_WARPS)
    SCALES_L: gl.constexpr = _rows_layout(8 // NUM_WARPS, 32 // NUM_WARPS, NUM_WARPS)
    CODES_L: gl.constexpr = _rows_layout(16, 4, NUM_WARPS)
    HALF_L: gl.constexpr = _rows_layout(8, 8, NUM_WARPS)
    IDX_L: gl.constexpr = _rows_layout(4, 16, NUM_WARPS)
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, NUM_WARPS // 4],
                                                  instr_shape=[16, BLOCK_H // (NUM_WARPS // 4), 16])
    HEADS: gl.constexpr = gl.SliceLayout(0, S_L)
    TOKENS: gl.constexpr = gl.SliceLayout(1, S_L)

    # ---- shared memory: Q (resident), the part's index list, the raw ring, the bf16 K tile, P^T.
    Q_N: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_NOPE], dtype)
    Q_R: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_ROPE], dtype)
    K_N: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_NOPE], dtype)
    K_R: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_ROPE], dtype)
    P_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype)
    q_nope = gl.allocate_shared_memory(dtype, [BLOCK_H, D_NOPE], Q_N)
    q_rope = gl.allocate_shared_memory(dtype, [BLOCK_H, D_ROPE], Q_R)
    codes_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, CODE_WORDS], WORDS_SMEM)
    scales_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, SCALE_WORDS], FLAT)
    rope_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, ROPE_WORDS], FLAT)
    idx_copy = gl.allocate_shared_memory(idx_ptr.dtype.element_ty, [IDX_TILES, BLOCK_N], FLAT)
    idx_list = smem_reinterpret(idx_copy, idx_ptr.dtype.element_ty, [IDX_TILES, BLOCK_N], FLAT1)  # by tile
    k_nope = gl.allocate_shared_memory(dtype, [BLOCK_N, D_NOPE], K_N)
    k_rope = gl.allocate_shared_memory(dtype, [BLOCK_N, D_ROPE], K_R)
    p_t = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], P_S)

    # ---- Q: HBM -> registers -> SMEM once (heads past h_q as zeros).
    heads_q = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, HALF_L))
    q_rows = q_ptr + req.to(gl.int64) * stride_qb + tok * stride_qs + heads_q * stride_qh
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, HALF_L))
    for c in gl.static_range(D_NOPE // 64):
        q_nope.slice(c * 64, 64, dim=1).store(
            gl.load(q_rows[:, None] + c * 64 + cols[None, :], mask=(heads_q < h_q)[:, None], other=0.0))
    q_rope.store(gl.load(q_rows[:, None] + D_NOPE + cols[None, :], mask=(heads_q < h_q)[:, None], other=0.0))

    # ---- this part's positions of the index list, [begin, end) cut to topk_length: HBM -> SMEM
    #      once (cp.async), so that no gather waits on an index load.
    n_valid = topk
    if HAS_LEN:
        n_valid = gl.minimum(gl.maximum(gl.load(len_ptr + req), 0), topk)
    begin = chunk * CHUNK
    n = gl.maximum(gl.minimum(begin + CHUNK, n_valid) - begin, 0)
    n_tiles = gl.cdiv(n, BLOCK_N)
    pos = (gl.arange(0, IDX_TILES, layout=gl.SliceLayout(1, IDX_L))[:, None] * BLOCK_N
           + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, IDX_L))[None, :])
    cp_async(idx_copy, idx_ptr + req.to(gl.int64) * stride_ib + tok * stride_is + begin + pos, mask=pos < n)
    cp_commit()
    cp_wait(0)
    thread_barrier()

    # ---- prologue: tiles 0 .. STAGES - 2 in flight.
    for t in gl.static_range(STAGES - 1):
        _gather(kc_ptr, idx_list, t, n, num_tokens, codes_ring.index(t), scales_ring.index(t), rope_ring.index(t),
                WORDS_L, SCALES_L)
        cp_commit()

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, HEADS)
    l_i = gl.zeros([BLOCK_H], gl.float32, HEADS)
    acc = gl.zeros([D_NOPE, BLOCK_H], gl.float32, S_L)
    for j in range(n_tiles):
        # ---- gather tile j + STAGES - 1 into the slot tile j - 1 left (an empty group past the end).
        s_next = (j + STAGES - 1) % STAGES
        _gather(kc_ptr, idx_list, j + STAGES - 1, n, num_tokens, codes_ring.index(s_next),
                scales_ring.index(s_next), rope_ring.index(s_next), WORDS_L, SCALES_L)
        cp_commit()
        # ---- tile j landed (this thread's copies; the barrier makes everyone's visible), then
        #      dequantized into the K tile, which the previous tile's MMAs have finished reading.
        slot = j % STAGES
        cp_wait(STAGES - 1)
        thread_barrier()
        _dequantize(codes_ring.index(slot), scales_ring.index(slot), rope_ring.index(slot), k_nope, k_rope, dtype,
                    CODES_L, HALF_L)
        fence_async_shared()
        thread_barrier()
        # ---- S^T = K Q^T on the tensor cores: [64 tokens, BLOCK_H heads].
        s = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, S_L)
        for c in gl.static_range(CHUNKS):
            s = warpgroup_mma(k_nope.slice(c * (D_NOPE // CHUNKS), D_NOPE // CHUNKS, dim=1),
                              q_nope.slice(c * (D_NOPE // CHUNKS), D_NOPE // CHUNKS, dim=1).permute((1, 0)), s,
                              use_acc=c > 0, is_async=True)
        s = warpgroup_mma(k_rope, q_rope.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        # ---- online softmax down the token axis (rows that name no token score -inf), then P V.
        ok, _ = _tile_rows(idx_list, j, n, num_tokens, TOKENS)
        m_i, l_i, acc = _softmax_pv_transposed(s, ok[:, None], qk_scale, m_i, l_i, acc, k_nope, p_t)
    cp_wait(0)

    # ---- registers -> HBM: the normalised partial [512] per head and its log2-sum-exp.
    has_keys = l_i != 0
    l_safe = gl.where(has_keys, l_i, 1.0)
    heads = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=HEADS)
    part = (unit.to(gl.int64) * num_chunks + chunk_base + chunk) * h_q + heads
    dims = gl.arange(0, D_NOPE, layout=TOKENS)
    gl.store(oacc_ptr + part[None, :] * D_NOPE + dims[:, None], acc / l_safe[None, :], mask=(heads < h_q)[None, :])
    gl.store(lseacc_ptr + part, gl.where(has_keys, m_i + gl.log2(l_safe), float("-inf")), mask=heads < h_q)
