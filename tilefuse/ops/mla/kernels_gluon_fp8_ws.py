"""The Gluon dense FP8 MLA decode's warp-specialized form (``kernels_gluon_fp8.mla_split_fp8_kernel``
with ``CONVERTERS > 0``): the dequantization runs in its own partition, beside the tensor cores.

The serial form (``CONVERTERS = 0``) has one consumer partition convert a 64-token tile, wait for
``S^T``, run the softmax and wait for ``P V`` in turn: per tile the sum of the stages, where only
the TMA copies overlap. Here three partitions walk the same run of splits:

  producer (1 warp)       TMA: slot ``r`` of ``SLOT_N`` tokens (codes, RoPE, scales boxes) -> ring
                          slot ``r % STAGES``, once the converters released slot ``r - STAGES``
  converters (CONVERTERS  per 64-token tile ``t``: once the MMA warpgroup released K buffer
  warps)                  ``t % 2``, each of the tile's ring slots: codes x their group's scale ->
                          fp16 rows of the K buffer, the RoPE bytes -> its bf16 rows (rows past the
                          request's length as 0); the ring slot released as soon as it is read
  MMA warpgroup (default, per split: Q -> SMEM; per tile: ``S^T = K Q^T``, the online softmax,
  4 warps)                ``O^T = O^T alpha + V^T P^T``, then the K buffer released; the output
                          leaves through the split's last K buffer before it is released

so the conversion of tile ``t + 1`` runs while the tensor cores work on tile ``t``, and the ring's
slots are free again after the conversion, not after the products: the copies run further ahead.
One MMA warpgroup holds all of the tile's query rows (``N = BLOCK_H``), so each WGMMA reads its
``A`` operand (the K tile) from shared memory once (8 consumer warps split N and read it twice).

Shared memory at ``BLOCK_H`` rows: two K buffers (2 x 72 KB: fp16 ``[64, 512]`` + bf16 ``[64,
64]``), Q (``BLOCK_H x 1152`` B), P^T, and a ring of ``STAGES`` slots of ``SLOT_N x 656`` B: 16
rows with 3 slots of 32 tokens, 32 rows with 2 (or 4 of 16 tokens), within 227 KB.

Measured on the H100 (docs/mla.md, "Dense FP8 decode"): 1.20-1.31x the serial form, 0.59-0.76 of
the copy bandwidth. With stages left out (``SKIP``, timing only) the producer alone reaches about
0.8 of it at 16K, and the converters and the MMA warpgroup each hide under it alone but cost about
a fifth together: two K buffers let the converters run one tile ahead, and both partitions share
the shared-memory pipe (about 290 KB per 64-token tile).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tilefuse.ops.gluon_compat import (cp_async, cp_commit, cp_wait, fence_async_shared, mbarrier, smem_reinterpret,
                                       thread_barrier, tma_load, warpgroup_mma, warpgroup_mma_wait)
from tilefuse.ops.mla.kernels_gluon import _split_range, _ws_store_lse, _zero_rows_past
from tilefuse.ops.mla.reference import FP8_GROUP, HEAD_DIM, HEAD_DIM_V

D_NOPE = gl.constexpr(HEAD_DIM_V)
D_ROPE = gl.constexpr(HEAD_DIM - HEAD_DIM_V)
BLOCK_N = gl.constexpr(64)                      # cached tokens per K tile: WGMMA's M of S^T
CODE_BOX = gl.constexpr(FP8_GROUP)              # codes per box: one scale group, one 128-byte row
CODE_BOXES = gl.constexpr(HEAD_DIM_V // FP8_GROUP)
ROPE_BYTE = gl.constexpr(HEAD_DIM_V + 16)       # RoPE after the codes and the 4 fp32 scales
SCALES = gl.constexpr(HEAD_DIM_V // FP8_GROUP)
FLAT = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
ROPE_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))


@gluon.jit
def split_work(meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot):
    """The work of ``slot`` (``kernels_gluon._split_range``'s first seven values): valid, request,
    first token, end token, length, partials of the request, this split's partial index."""
    w = _split_range(meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot)
    return w[0], w[1], w[2], w[3], w[4], w[5], w[6]


@gluon.jit
def load_q_rows(q_ptr, q_nope, q_rope, req, pid_h, h_q, rows_total, stride_qb, stride_qs, stride_qh,
                BLOCK_H: gl.constexpr, NUM_WARPS: gl.constexpr):
    """HBM -> SMEM: a split's BLOCK_H query rows (row r: query token r // h_q, head r % h_q; rows
    past ``s_q * h_q`` as 0): the RoPE part as it is (cp.async), the 512-wide part through
    registers, converted to fp16 (the K tile's type; bf16 -> fp16 is exact within fp16's range)."""
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    rows = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LOAD))
    q_rows = (q_ptr + req * stride_qb + (rows // h_q) * stride_qs + (rows % h_q) * stride_qh)[:, None]
    ok = (rows < rows_total)[:, None]
    cols = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, LOAD))[None, :]
    cp_async(q_rope, gl.max_contiguous(gl.multiple_of(q_rows + D_NOPE + cols, [1, 16]), [1, 8]), mask=ok)
    cp_commit()
    for c in gl.static_range(0, D_NOPE, D_ROPE):
        src = gl.max_contiguous(gl.multiple_of(q_rows + c + cols, [1, 16]), [1, 8])
        q_nope.slice(c, D_ROPE, dim=1).store(gl.load(src, mask=ok, other=0.0).to(q_nope.dtype))
    cp_wait(0)
    fence_async_shared()
    thread_barrier()


@gluon.jit
def _issue_slot(codes_desc, scales_desc, codes_ring, rope_ring, scales_ring, bar, bt_row, start, s, last_page,
                num_blocks, KV_PAGE: gl.constexpr, SLOT_N: gl.constexpr):
    """HBM -> SMEM: TMA copies of tokens ``start .. start + SLOT_N - 1`` into ring slot ``s`` (codes
    as four 128-byte boxes, RoPE bytes, scales); ``bar`` flips when every byte has landed. Pages
    from the block table (column clamped to the split's last page, entry to the cache); boxes of
    ``min(KV_PAGE, SLOT_N)`` rows (the descriptors'), several side by side for shorter pages."""
    BOX: gl.constexpr = codes_desc.block_type.shape[0]
    mbarrier.expect(bar, (SLOT_N // BOX) * ((CODE_BOXES + 1) * codes_desc.block_type.nbytes
                                            + scales_desc.block_type.nbytes))
    for sub in gl.static_range(SLOT_N // BOX):
        token = start + sub * BOX
        page = gl.load(bt_row + gl.minimum(token // KV_PAGE, last_page))
        page = gl.minimum(gl.maximum(page, 0), num_blocks - 1)
        row = page * KV_PAGE + token % KV_PAGE
        for b in gl.static_range(CODE_BOXES):
            tma_load(codes_desc, [row, b * CODE_BOX], bar,
                     codes_ring.index(s * CODE_BOXES + b).slice(sub * BOX, BOX, dim=0))
        tma_load(codes_desc, [row, ROPE_BYTE], bar, rope_ring.index(s).slice(sub * BOX, BOX, dim=0))
        tma_load(scales_desc, [row, 0], bar, scales_ring.index(s).slice(sub * BOX, BOX, dim=0))


@gluon.jit
def fp8_ws_producer(codes_desc, scales_desc, codes_ring, rope_ring, scales_ring, r_ready, r_empty, bt_ptr, stride_btb,
                    meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, num_blocks, slot_first,
                    slot_last, STAGES: gl.constexpr, KV_PAGE: gl.constexpr, SLOT_N: gl.constexpr):
    r = 0                                  # ring slots issued so far (slot index and phases)
    for slot in range(slot_first, slot_last):
        valid, req, tok_begin, tok_end, length, n_part, part_idx = split_work(
            meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot)
        if valid:
            bt_row = bt_ptr + req * stride_btb
            last_page = gl.maximum(tok_end - 1, 0) // KV_PAGE
            for start in range(tok_begin, tok_end, BLOCK_N):
                for h in gl.static_range(BLOCK_N // SLOT_N):
                    # ring slot r % STAGES is free once the converters read slot r - STAGES (a
                    # fresh barrier passes the parity-1 wait: the first round finds all free)
                    mbarrier.wait(r_empty.index(r % STAGES), ((r // STAGES) & 1) ^ 1)
                    _issue_slot(codes_desc, scales_desc, codes_ring, rope_ring, scales_ring, r_ready.index(r % STAGES),
                                bt_row, start + h * SLOT_N, r % STAGES, last_page, num_blocks, KV_PAGE, SLOT_N)
                    r += 1


@gluon.jit
def fp8_ws_converter(codes_ring, rope_ring, scales_ring, kn_buf, kr_buf, r_ready, r_empty, kb_full, kb_empty,
                     meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot_first, slot_last,
                     STAGES: gl.constexpr, SLOT_N: gl.constexpr, SKIP: gl.constexpr):
    # Each thread converts 16 codes of a row (8 threads walk 8 rows at the same columns, so each
    # 16-byte access of a phase lands in a different swizzled bank group); warps down the rows,
    # two across the 128 codes of a group where the slot has fewer rows than 8 per warp.
    NW: gl.constexpr = gl.num_warps()
    WR: gl.constexpr = NW if 8 * NW <= SLOT_N else SLOT_N // 8
    WC: gl.constexpr = NW // WR
    gl.static_assert(WC <= 2, "the converters' layout: at most 2 warps across a 128-code group")
    ROWS: gl.constexpr = 8 * WR
    CODES_L: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [WR, WC], [0, 1])
    ROPE_L: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [WR, WC], [0, 1])
    t = 0                                  # K tiles converted so far (K buffer t % 2 and phases)
    r = 0                                  # ring slots read so far
    for slot in range(slot_first, slot_last):
        valid, req, tok_begin, tok_end, length, n_part, part_idx = split_work(
            meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot)
        if valid:
            for start in range(tok_begin, tok_end, BLOCK_N):
                b = t % 2
                kn = kn_buf.index(b)
                kr = kr_buf.index(b)
                # K buffer b is free once the MMA warpgroup is done with tile t - 2
                mbarrier.wait(kb_empty.index(b), ((t // 2) & 1) ^ 1)
                for h in gl.static_range(BLOCK_N // SLOT_N):
                    s = r % STAGES
                    mbarrier.wait(r_ready.index(s), (r // STAGES) & 1)
                    if SKIP % 2 == 0:      # (SKIP odd, timing only: no conversion)
                        _convert_slot(codes_ring, rope_ring, scales_ring, kn, kr, s, start + h * SLOT_N, length,
                                      h * SLOT_N, SLOT_N, ROWS, CODES_L, ROPE_L)
                    mbarrier.arrive(r_empty.index(s))      # read: the producer may refill the slot
                    r += 1
                # the tile's stores visible to the tensor cores, then handed over
                fence_async_shared()
                mbarrier.arrive(kb_full.index(b))
                t += 1


@gluon.jit
def _convert_slot(codes_ring, rope_ring, scales_ring, kn, kr, s, first, length, row0: gl.constexpr,
                  SLOT_N: gl.constexpr, ROWS: gl.constexpr, CODES_L: gl.constexpr, ROPE_L: gl.constexpr):
    """SMEM -> registers -> SMEM: ring slot ``s`` (tokens ``first ..``) into rows ``row0 ..`` of the
    K buffer ``kn`` / ``kr``, ``ROWS`` rows at a time."""
    scale32 = smem_reinterpret(scales_ring.index(s), gl.float32, [SLOT_N, SCALES], FLAT)
    rope = smem_reinterpret(rope_ring.index(s), kr.dtype, [SLOT_N, D_ROPE], ROPE_SMEM)
    for r0 in gl.static_range(0, SLOT_N, ROWS):
        # ---- codes -> fp16 (exact, one conversion per two codes) x the group's scale, rounded
        #      once; rows past the length as 0 (NaN bytes there)
        pos = first + r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, CODES_L))
        keep = (pos < length)[:, None]
        for g in gl.static_range(CODE_BOXES):
            scale = scale32.slice(r0, ROWS, dim=0).slice(g, 1, dim=1).load(CODES_L)
            codes = codes_ring.index(s * CODE_BOXES + g).slice(r0, ROWS, dim=0).load(CODES_L)
            v = codes.to(gl.float16) * scale.to(gl.float16)
            v = gl.where(keep, v, gl.zeros_like(v))
            kn.slice(row0 + r0, ROWS, dim=0).slice(g * CODE_BOX, CODE_BOX, dim=1).store(v)
        # ---- RoPE bytes (bf16 as they landed) -> the K buffer's RoPE rows
        pos_r = first + r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, ROPE_L))
        rv = rope.slice(r0, ROWS, dim=0).load(ROPE_L)
        rv = gl.where((pos_r < length)[:, None], rv, gl.zeros_like(rv))
        kr.slice(row0 + r0, ROWS, dim=0).store(rv)


@gluon.jit
def _issue_scores(kn_buf, kr_buf, q_nope, q_rope, kb_full, t, start, length, S_L: gl.constexpr,
                  BLOCK_H: gl.constexpr, ZERO_TAIL: gl.constexpr):
    """SMEM -> tensor cores: ``S^T = K Q^T`` of the program's tile ``t`` (tokens from ``start``)
    issued asynchronously, once its K buffer (``t % 2``) is full; the RoPE part into the same
    accumulator. ``ZERO_TAIL`` (a buffer filled by TMA straight from a 16-bit cache, not by the
    converters, which zero them): the request's last tile has its rows past ``length`` zeroed
    first (whatever the cache held there, NaN included, must not reach ``0 x NaN`` in P V)."""
    b = t % 2
    mbarrier.wait(kb_full.index(b), (t // 2) & 1)
    if ZERO_TAIL:
        if start + BLOCK_N > length:
            LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
            _zero_rows_past(kn_buf.index(b), start, length, BLOCK_N, D_NOPE, LOAD, 128)
            _zero_rows_past(kr_buf.index(b), start, length, BLOCK_N, D_ROPE, LOAD, D_ROPE)
            fence_async_shared()
            thread_barrier()
    s = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, S_L)
    s = warpgroup_mma(kn_buf.index(b), q_nope.permute((1, 0)), s, use_acc=False, is_async=True)
    return warpgroup_mma(kr_buf.index(b), q_rope.permute((1, 0)), s, is_async=True)


@gluon.jit
def _store_out(o, stage, has_tiles, pid_h, req, part_idx, n_part, rows_total, h_q, out_ptr, oacc_ptr, stride_ob,
               stride_os, stride_oh, BLOCK_H: gl.constexpr):
    """registers -> SMEM -> HBM: the normalised O^T ``[512, BLOCK_H]`` fp32 of a split, final (q's
    dtype) or partial (fp32), through ``stage`` (the split's last K buffer, still held), so each
    thread stores 4 contiguous columns of a row; a split without tokens stores zeros directly."""
    OUT: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, 4], [0, 1])
    CHUNK: gl.constexpr = 128
    view = smem_reinterpret(stage, gl.float32, [D_NOPE, BLOCK_H], FLAT)
    if has_tiles:
        thread_barrier()                  # every warp's products from the stage are done
        view.store(o)
        thread_barrier()
    rows = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, OUT))
    ok = (rows < rows_total)[None, :]
    dims = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, OUT))[:, None]
    final = out_ptr + req * stride_ob + (rows // h_q) * stride_os + (rows % h_q) * stride_oh
    partial = oacc_ptr + (part_idx * rows_total + rows).to(gl.int64) * D_NOPE
    for c in gl.static_range(0, D_NOPE, CHUNK):
        if has_tiles:
            v = view.slice(c, CHUNK, dim=0).load(OUT)
        else:
            v = gl.zeros([CHUNK, BLOCK_H], gl.float32, OUT)
        if n_part == 1:
            gl.store(final[None, :] + c + dims, v.to(out_ptr.dtype.element_ty), mask=ok)
        else:
            gl.store(partial[None, :] + c + dims, v, mask=ok)
    thread_barrier()                      # every read of the stage done before it is released


@gluon.jit
def fp8_ws_mma(q_ptr, q_nope, q_rope, kn_buf, kr_buf, p_t, kb_full, kb_empty, meta_ptr, splits_ptr, seqlens_ptr, batch,
               num_slots, max_tokens, slot_first, slot_last, pid_h, h_q, s_q, qk_scale, rows_total, out_ptr, lse_ptr,
               oacc_ptr, lseacc_ptr, stride_qb, stride_qs, stride_qh, stride_ob, stride_os, stride_oh, stride_lb,
               stride_lh, CAUSAL: gl.constexpr, BLOCK_H: gl.constexpr, MMA_AHEAD: gl.constexpr, SKIP: gl.constexpr,
               ZERO_TAIL: gl.constexpr):
    # (also the MMA warpgroup of kernels_gluon_t's 16-bit kernel, whose producer fills the K
    # buffers by TMA: ZERO_TAIL clears a request's last tile past its length before its products)
    # S^T and O^T as one warpgroup's WGMMA accumulates them: all BLOCK_H rows as N.
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_H, 16])
    ROWS: gl.constexpr = gl.SliceLayout(0, S_L)          # query rows (N)
    TOKENS: gl.constexpr = gl.SliceLayout(1, S_L)        # cached tokens (M)
    rows = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROWS)
    t = 0
    for slot in range(slot_first, slot_last):
        valid, req, tok_begin, tok_end, length, n_part, part_idx = split_work(
            meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot)
        if valid:
            # ---- this split's Q (the last split's products have all been waited for).
            load_q_rows(q_ptr, q_nope, q_rope, req, pid_h, h_q, rows_total, stride_qb, stride_qs, stride_qh,
                        BLOCK_H, 4)
            # causal: query token r // h_q of s_q sees keys up to L - s_q + r // h_q
            limit = length - 1 - gl.where(CAUSAL, s_q - 1 - rows // h_q, 0)
            m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROWS)
            l_i = gl.zeros([BLOCK_H], gl.float32, ROWS)
            acc = gl.zeros([D_NOPE, BLOCK_H], gl.float32, S_L)
            s = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, S_L)
            for start in range(tok_begin, tok_end, BLOCK_N):
                b = t % 2
                kn = kn_buf.index(b)
                if SKIP >= 2:          # timing only: no products (the hand-offs alone)
                    mbarrier.wait(kb_full.index(b), (t // 2) & 1)
                else:
                    # ---- S^T = K Q^T: [64, 576] x [576, BLOCK_H], both parts from the K buffer
                    #      (MMA_AHEAD: issued during the previous tile, after its P V).
                    if MMA_AHEAD:
                        if start == tok_begin:
                            s = warpgroup_mma_wait(0, deps=(_issue_scores(kn_buf, kr_buf, q_nope, q_rope, kb_full,
                                                                          t, start, length, S_L, BLOCK_H,
                                                                          ZERO_TAIL),))
                        s = warpgroup_mma_wait(0, deps=(s,))
                    else:
                        s = warpgroup_mma_wait(0, deps=(_issue_scores(kn_buf, kr_buf, q_nope, q_rope, kb_full, t,
                                                                      start, length, S_L, BLOCK_H, ZERO_TAIL),))
                    # ---- online softmax down the token axis (keys past the length or the causal
                    #      limit score -inf; the row sum from the fp32 probabilities), P^T -> SMEM.
                    pos = start + gl.arange(0, BLOCK_N, layout=TOKENS)
                    s = gl.where(pos[:, None] <= limit[None, :], s * qk_scale, float("-inf"))
                    m_new = gl.maximum(m_i, gl.max(s, axis=0))
                    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = gl.exp2(m_i - m_safe)
                    p = gl.exp2(s - m_safe[None, :])
                    l_i = l_i * alpha + gl.sum(p, axis=0)
                    m_i = m_new
                    p_t.store(gl.permute(p.to(p_t.dtype), (1, 0)))
                    fence_async_shared()
                    thread_barrier()
                    # ---- O^T = O^T alpha + V^T P^T (V^T: the K buffer read transposed); with
                    #      MMA_AHEAD the next tile's S^T is issued behind it, so the tensor cores
                    #      run it while this warpgroup waits for P V and releases the buffer.
                    pv = warpgroup_mma(kn.permute((1, 0)), p_t.permute((1, 0)), acc * alpha[None, :], is_async=True)
                    if MMA_AHEAD:
                        if start + BLOCK_N < tok_end:
                            s_next = _issue_scores(kn_buf, kr_buf, q_nope, q_rope, kb_full, t + 1, start + BLOCK_N,
                                                   length, S_L, BLOCK_H, ZERO_TAIL)
                            # P V done (the groups retire in order); the next S^T may still run
                            acc, s = warpgroup_mma_wait(1, deps=(pv, s_next))
                        else:
                            acc = warpgroup_mma_wait(0, deps=(pv,))
                    else:
                        acc = warpgroup_mma_wait(0, deps=(pv,))
                # the buffer goes back to the converters, except the split's last: the output
                # leaves through it first
                mbarrier.arrive(kb_empty.index(b), pred=start + BLOCK_N < tok_end)
                t += 1
            # ---- registers -> HBM: the normalised output (one split) or partial, and the lse.
            has_keys = l_i != 0                 # NaN counts as keys: a NaN score reaches out and lse
            l_safe = gl.where(has_keys, l_i, 1.0)
            has_tiles = tok_end > tok_begin
            last = (t + 1) % 2                  # the buffer of tile t - 1
            _store_out(acc / l_safe[None, :], kn_buf.index(last), has_tiles, pid_h, req, part_idx, n_part,
                       rows_total, h_q, out_ptr, oacc_ptr, stride_ob, stride_os, stride_oh, BLOCK_H)
            mbarrier.arrive(kb_empty.index(last), pred=has_tiles)
            _ws_store_lse(gl.where(has_keys, m_i + gl.log2(l_safe), float("-inf")), rows, req, part_idx, n_part,
                          rows_total, h_q, lse_ptr, lseacc_ptr, stride_lb, stride_lh)
