"""The Gluon dense FP8 MLA decode's register-operand form (``kernels_gluon_fp8.mla_split_fp8_kernel``
with ``RS = 1``): the tensor cores read K and V^T from registers, converted from the ring's e4m3
codes by the MMA warpgroup itself, so no 16-bit copy of the tile exists in shared memory.

The warp-specialized form (``kernels_gluon_fp8_ws``) has converter warps write each 64-token tile
as fp16 into one of two 72 KB K buffers that ``S^T`` and ``P V`` read: 144 KB of the SM's 227 KB,
which leaves 42-63 KB for the ring of raw pages (1-1.5 tiles in flight), and about 290 KB of
shared-memory traffic per tile. Here the only tiles in shared memory are the raw ones:

  producer (1 warp)     TMA: tile ``t`` (64 tokens: codes as four ``[64, 128]`` byte boxes, RoPE
                        bytes, ``[64, 4]`` fp32 scales) -> ring slot ``t % STAGES`` once the MMA
                        warpgroup released tile ``t - STAGES`` (``kernels_gluon_fp8_ws``'s producer)
  MMA warpgroup         per tile, from ring slot ``t % STAGES``:
  (default, 4 warps)    * ``S^T = K Q^T``: the RoPE part as a bf16 WGMMA straight from the landed
                          bytes; each 128-code group loaded into WGMMA's register A operand (two
                          codes per 16-bit load), one ``cvt`` per two codes to fp16 (exact), times
                          the token's group scale (a power of two: exact), against Q's fp16 group
                          in shared memory
                        * the online softmax down the token axis
                        * ``O^T = O^T alpha + V^T P^T`` per group ``g``: V^T's codes loaded into
                          the register operand (the codes transposed: byte loads), cast to fp16
                          (exact, no scale); the scale goes into P instead: ``P_g = P x s_g / c_g``
                          (``s_g``: the tokens' group-``g`` scales, ``c_g`` their largest in the
                          tile, so ``P_g <= 1`` stays in fp16's normal range) and ``c_g`` into the
                          group's accumulator, kept in units of its tile's ``c_g`` (``O_g = R_g x
                          acc_g``: one multiply per tile, merged with ``alpha``)
                        then the ring slot goes back to the producer

Shared memory at ``BLOCK_H`` rows: Q (``BLOCK_H x 1152`` B), four P_g^T (``4 x BLOCK_H x 128``
B), and ``STAGES`` ring slots of 41 KB: 4 slots (2.5 times the warp-specialized form's bytes in
flight) within 227 KB at 16 and 32 rows. The same numerics as the other forms: K and V are the
cache's values exactly in fp16, P is rounded once to fp16, every product accumulates in fp32.

``RS = 2``: two MMA warpgroups take every other tile of a program, each with a softmax state
of its own; at the end of a split the second writes its O^T, row max and row sum to shared
memory and the first merges them into the output (3 ring slots at 16 rows, 2 at 32).

The grid, the schedule (runs of splits), the outputs and partials are the other forms'.

Measured on the H100 (docs/mla.md, "Dense FP8 decode"; bench/results/sweeps/
mla-fp8-rs-nvidia-h100-80gb-hbm3.json): correct, within the warp-specialized form's error, but
1.5-2.2x its time at 16-32 rows (258 against 175 us at b32 h16 16K), so it is not the default.
Without ``P V`` (``SKIP = 2``) the tile stream takes 146 us, without ``S^T`` (``SKIP = 1``) 154,
the ring alone 135: each product alone hides under the copies, but one warpgroup issuing the
conversions, both products and the softmax of a tile in turn does not; two warpgroups
(``RS = 2``, 232 registers each: spills) were no faster there.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tilefuse.ops.gluon_compat import (fence_async_shared, mbarrier, smem_reinterpret, thread_barrier,
                                       warpgroup_mma, warpgroup_mma_wait)
from tilefuse.ops.mla.kernels_gluon import _ws_store_lse
from tilefuse.ops.mla.kernels_gluon_fp8_ws import (BLOCK_N, CODE_BOX, CODE_BOXES, D_NOPE, D_ROPE, FLAT, ROPE_SMEM,
                                                  SCALES, fp8_ws_producer, load_q_rows, split_work)


@gluon.jit
def _tile_scales(scales_ring, s, start, length, SC_L: gl.constexpr):
    """SMEM -> registers: ring slot ``s``'s ``[64, 4]`` fp32 group scales (each thread a token's
    four), tokens at or past ``length`` as 0 (whatever the cache held there)."""
    sc = smem_reinterpret(scales_ring.index(s), gl.float32, [BLOCK_N, SCALES], FLAT).load(SC_L)
    pos = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, SC_L))
    return gl.where((pos < length)[:, None], sc, 0.0)


@gluon.jit
def _column(x, g: gl.constexpr, SC_L: gl.constexpr, LAYOUT: gl.constexpr):
    """Column ``g`` of a ``[64, 4]`` tensor (each thread holds whole rows) in ``LAYOUT``."""
    cols = gl.arange(0, SCALES, layout=gl.SliceLayout(0, SC_L))
    return gl.convert_layout(gl.sum(gl.where(cols[None, :] == g, x, 0.0), axis=1), LAYOUT)


@gluon.jit
def _entry(v, g: gl.constexpr, SC_L: gl.constexpr):
    """Entry ``g`` of a ``[4]`` tensor that every thread holds whole, as a scalar."""
    cols = gl.arange(0, SCALES, layout=gl.SliceLayout(0, SC_L))
    return gl.sum(gl.where(cols == g, v, 0.0), axis=0)


@gluon.jit
def _k_operand(codes_ring, s, g: gl.constexpr, sc, SC_L: gl.constexpr, A_L: gl.constexpr):
    """SMEM -> registers: group ``g`` of ring slot ``s`` as ``S^T``'s A operand ``[64 tokens, 128]``
    in fp16: codes (exact) x the token's group scale (exact for power-of-two scales), rounded once
    (the warp-specialized form's values)."""
    codes = codes_ring.index(s * CODE_BOXES + g).load(A_L).to(gl.float16)
    scale = _column(sc, g, SC_L, gl.SliceLayout(1, A_L)).to(gl.float16)
    return codes * scale[:, None]


@gluon.jit
def _v_operand(codes_ring, s, g: gl.constexpr, start, length, A_L: gl.constexpr):
    """SMEM -> registers: group ``g`` of ring slot ``s`` as ``O^T``'s A operand ``V^T [128, 64
    tokens]``, the codes cast to fp16 (exact; the scale is in P). In a request's last tile the
    tokens at or past ``length`` are 0: NaN bytes there must not reach ``0 x NaN``."""
    v = codes_ring.index(s * CODE_BOXES + g).permute((1, 0)).load(A_L).to(gl.float16)
    if start + BLOCK_N > length:
        pos = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, A_L))
        v = gl.where((pos < length)[None, :], v, gl.zeros_like(v))
    return v


@gluon.jit
def _scores(codes_ring, rope_ring, q_nope, q_rope, s, sc, SC_L: gl.constexpr, A_L: gl.constexpr,
            S_L: gl.constexpr, BLOCK_H: gl.constexpr):
    """``S^T = K Q^T`` of ring slot ``s`` ([64 tokens, BLOCK_H] fp32, waited for): the RoPE part
    from the landed bytes, each code group from registers (the next group's loads and conversions
    run under the previous group's WGMMA)."""
    rope = smem_reinterpret(rope_ring.index(s), q_rope.dtype, [BLOCK_N, D_ROPE], ROPE_SMEM)
    acc = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, S_L)
    acc = warpgroup_mma(rope, q_rope.permute((1, 0)), acc, use_acc=False, is_async=True)
    k0 = _k_operand(codes_ring, s, 0, sc, SC_L, A_L)
    acc = warpgroup_mma(k0, q_nope.slice(0, CODE_BOX, dim=1).permute((1, 0)), acc, is_async=True)
    k1 = _k_operand(codes_ring, s, 1, sc, SC_L, A_L)
    acc = warpgroup_mma(k1, q_nope.slice(CODE_BOX, CODE_BOX, dim=1).permute((1, 0)), acc, is_async=True)
    acc, k0 = warpgroup_mma_wait(1, deps=(acc, k0))
    k2 = _k_operand(codes_ring, s, 2, sc, SC_L, A_L)
    acc = warpgroup_mma(k2, q_nope.slice(2 * CODE_BOX, CODE_BOX, dim=1).permute((1, 0)), acc, is_async=True)
    acc, k1 = warpgroup_mma_wait(1, deps=(acc, k1))
    k3 = _k_operand(codes_ring, s, 3, sc, SC_L, A_L)
    acc = warpgroup_mma(k3, q_nope.slice(3 * CODE_BOX, CODE_BOX, dim=1).permute((1, 0)), acc, is_async=True)
    acc, k2 = warpgroup_mma_wait(1, deps=(acc, k2))
    acc, k3 = warpgroup_mma_wait(0, deps=(acc, k3))
    return acc

@gluon.jit
def _products(codes_ring, p_t, o0, o1, o2, o3, alpha, rescale, s, start, length, SC_L: gl.constexpr,
              A_L: gl.constexpr, P0: gl.constexpr):
    """``O_g^T = O_g^T alpha R_g / c_g + V_g^T P_g^T`` for the four groups of ring slot ``s``, one
    after another, the next group's codes loaded and cast under the previous group's WGMMA."""
    v0 = _v_operand(codes_ring, s, 0, start, length, A_L)
    o0 = o0 * (alpha * _entry(rescale, 0, SC_L))[None, :]
    o0 = warpgroup_mma(v0, p_t.index(P0 + 0).permute((1, 0)), o0, is_async=True)
    v1 = _v_operand(codes_ring, s, 1, start, length, A_L)
    o1 = o1 * (alpha * _entry(rescale, 1, SC_L))[None, :]
    o1 = warpgroup_mma(v1, p_t.index(P0 + 1).permute((1, 0)), o1, is_async=True)
    o0, v0 = warpgroup_mma_wait(1, deps=(o0, v0))
    v2 = _v_operand(codes_ring, s, 2, start, length, A_L)
    o2 = o2 * (alpha * _entry(rescale, 2, SC_L))[None, :]
    o2 = warpgroup_mma(v2, p_t.index(P0 + 2).permute((1, 0)), o2, is_async=True)
    o1, v1 = warpgroup_mma_wait(1, deps=(o1, v1))
    v3 = _v_operand(codes_ring, s, 3, start, length, A_L)
    o3 = o3 * (alpha * _entry(rescale, 3, SC_L))[None, :]
    o3 = warpgroup_mma(v3, p_t.index(P0 + 3).permute((1, 0)), o3, is_async=True)
    o2, v2 = warpgroup_mma_wait(1, deps=(o2, v2))
    o3, v3 = warpgroup_mma_wait(0, deps=(o3, v3))
    return o0, o1, o2, o3


@gluon.jit
def _store_group(o, g: gl.constexpr, pid_h, req, part_idx, n_part, rows_total, h_q, out_ptr, oacc_ptr, stride_ob,
                 stride_os, stride_oh, S_L: gl.constexpr, BLOCK_H: gl.constexpr):
    """registers -> HBM: columns ``128 g ..`` of a split's normalised output (``O_g^T [128,
    BLOCK_H]`` fp32), final (q's dtype) or partial (fp32), from the accumulator's layout."""
    rows = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, S_L))
    ok = (rows < rows_total)[None, :]
    dims = g * CODE_BOX + gl.arange(0, CODE_BOX, layout=gl.SliceLayout(1, S_L))[:, None]
    if n_part == 1:
        final = out_ptr + req * stride_ob + (rows // h_q) * stride_os + (rows % h_q) * stride_oh
        gl.store(final[None, :] + dims, o.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        partial = oacc_ptr + (part_idx * rows_total + rows).to(gl.int64) * D_NOPE
        gl.store(partial[None, :] + dims, o, mask=ok)


@gluon.jit
def fp8_rs_mma(q_ptr, q_nope, q_rope, codes_ring, rope_ring, scales_ring, p_t, r_ready, r_empty, x_o, x_ml, sync,
               meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot_first, slot_last, pid_h, h_q, s_q,
               qk_scale, rows_total, out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, stride_qb, stride_qs, stride_qh,
               stride_ob, stride_os, stride_oh, stride_lb, stride_lh, CAUSAL: gl.constexpr, BLOCK_H: gl.constexpr,
               STAGES: gl.constexpr, SKIP: gl.constexpr, WGS: gl.constexpr, WG: gl.constexpr):
    # MMA warpgroup WG of WGS: with two, each takes every other tile of the program (t % 2 == WG)
    # with a softmax state of its own; WG 0 loads each split's Q (sync 0: loaded, sync 1: WG 1 is
    # done with it) and merges WG 1's state (x_o: its O^T, x_ml: its row max and sum; sync 2:
    # written, sync 3: read) into the split's output.
    # S^T / O_g^T as one warpgroup's WGMMA accumulates them (all BLOCK_H rows as N), the register
    # A operand of both products, the scales (each thread a token's four).
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_H, 16])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S_L, k_width=2)
    # the scales: each thread the four of the tokens whose S^T rows it holds (16 w + lane / 4, + 8)
    SC_L: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [8, 0]],
                                                    lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
                                                    warp_bases=[[16, 0], [32, 0]], block_bases=[],
                                                    shape=[BLOCK_N, SCALES])
    ROWS: gl.constexpr = gl.SliceLayout(0, S_L)          # query rows (N)
    TOKENS: gl.constexpr = gl.SliceLayout(1, S_L)        # cached tokens (M of S^T)
    rows = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROWS)
    t = 0
    j = 0                                   # splits so far (the Q and exchange barriers' phases)
    for slot in range(slot_first, slot_last):
        valid, req, tok_begin, tok_end, length, n_part, part_idx = split_work(
            meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot)
        if valid:
            # ---- this split's Q (the last split's products have all been waited for; with two
            #      warpgroups WG 0 loads it once WG 1 is done with the last one).
            if WG == 0:
                if WGS == 2:
                    mbarrier.wait(sync.index(1), (j & 1) ^ 1)
                load_q_rows(q_ptr, q_nope, q_rope, req, pid_h, h_q, rows_total, stride_qb, stride_qs, stride_qh,
                            BLOCK_H, 4)
                if WGS == 2:
                    mbarrier.arrive(sync.index(0))
            else:
                mbarrier.wait(sync.index(0), j & 1)
            # causal: query token r // h_q of s_q sees keys up to L - s_q + r // h_q
            limit = length - 1 - gl.where(CAUSAL, s_q - 1 - rows // h_q, 0)
            m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROWS)
            l_i = gl.zeros([BLOCK_H], gl.float32, ROWS)
            o0 = gl.zeros([CODE_BOX, BLOCK_H], gl.float32, S_L)
            o1 = gl.zeros([CODE_BOX, BLOCK_H], gl.float32, S_L)
            o2 = gl.zeros([CODE_BOX, BLOCK_H], gl.float32, S_L)
            o3 = gl.zeros([CODE_BOX, BLOCK_H], gl.float32, S_L)
            # O_g = units * o_g: the group's accumulator in units of its last tile's largest scale
            units = gl.full([SCALES], 1.0, gl.float32, gl.SliceLayout(0, SC_L))
            for start in range(tok_begin, tok_end, BLOCK_N):
                if t % WGS == WG:
                    s = t % STAGES
                    mbarrier.wait(r_ready.index(s), (t // STAGES) & 1)
                    if SKIP == 3:          # timing only: the producer's ring alone (results wrong)
                        mbarrier.arrive(r_empty.index(s))
                    else:
                        sc = _tile_scales(scales_ring, s, start, length, SC_L)
                        # ---- S^T = K Q^T: [64, 576] x [576, BLOCK_H] (SKIP 1, timing only: none)
                        if SKIP == 1:
                            acc = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, S_L)
                        else:
                            acc = _scores(codes_ring, rope_ring, q_nope, q_rope, s, sc, SC_L, A_L, S_L, BLOCK_H)
                        # ---- online softmax down the token axis (keys past the length or the causal
                        #      limit score -inf; the row sum from the fp32 probabilities)
                        pos = start + gl.arange(0, BLOCK_N, layout=TOKENS)
                        acc = gl.where(pos[:, None] <= limit[None, :], acc * qk_scale, float("-inf"))
                        m_new = gl.maximum(m_i, gl.max(acc, axis=0))
                        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                        alpha = gl.exp2(m_i - m_safe)
                        p = gl.exp2(acc - m_safe[None, :])
                        l_i = l_i * alpha + gl.sum(p, axis=0)
                        m_i = m_new
                        # ---- P_g = P x s_g / c_g -> SMEM (fp16, <= 1); O_g^T's factor alpha R_g / c_g
                        big = gl.max(sc, axis=0)                            # c_g: the tile's largest scales
                        big = gl.where(big > 0, big, 1.0)
                        ratio = sc / big[None, :]
                        for g in gl.static_range(CODE_BOXES):
                            pg = p * _column(ratio, g, SC_L, TOKENS)[:, None]
                            p_t.index(WG * CODE_BOXES + g).store(gl.permute(pg.to(p_t.dtype), (1, 0)))
                        fence_async_shared()
                        thread_barrier()
                        rescale = units / big
                        units = big
                        # ---- O_g^T = O_g^T alpha R_g / c_g + V_g^T P_g^T (SKIP 2, timing only: none)
                        if SKIP != 2:
                            o0, o1, o2, o3 = _products(codes_ring, p_t, o0, o1, o2, o3, alpha, rescale, s, start,
                                                       length, SC_L, A_L, WG * CODE_BOXES)
                        mbarrier.arrive(r_empty.index(s))        # every read of the slot is done: refill it
                t += 1
            o0 = o0 * _entry(units, 0, SC_L)
            o1 = o1 * _entry(units, 1, SC_L)
            o2 = o2 * _entry(units, 2, SC_L)
            o3 = o3 * _entry(units, 3, SC_L)
            if WGS == 2:
                if WG == 1:
                    # ---- WG 1: done with Q; its state -> SMEM for WG 0 (once WG 0 read the last)
                    mbarrier.arrive(sync.index(1))
                    mbarrier.wait(sync.index(3), (j & 1) ^ 1)
                    x_o.slice(0, CODE_BOX, dim=0).store(o0)
                    x_o.slice(CODE_BOX, CODE_BOX, dim=0).store(o1)
                    x_o.slice(2 * CODE_BOX, CODE_BOX, dim=0).store(o2)
                    x_o.slice(3 * CODE_BOX, CODE_BOX, dim=0).store(o3)
                    half = (gl.arange(0, BLOCK_N, layout=TOKENS) < BLOCK_N // 2)[:, None]
                    x_ml.store(gl.where(half, m_i[None, :], l_i[None, :]))      # m in rows 0-31, l below
                    mbarrier.arrive(sync.index(2))
                else:
                    # ---- WG 0: merge WG 1's state, O = O_0 2^(m_0 - m) + O_1 2^(m_1 - m)
                    mbarrier.wait(sync.index(2), j & 1)
                    half = (gl.arange(0, BLOCK_N, layout=TOKENS) < BLOCK_N // 2)[:, None]
                    ml = x_ml.load(S_L)
                    m_1 = gl.max(gl.where(half, ml, float("-inf")), axis=0)
                    l_1 = gl.max(gl.where(half, float("-inf"), ml), axis=0)
                    m_new = gl.maximum(m_i, m_1)
                    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                    a_0 = gl.exp2(m_i - m_safe)
                    a_1 = gl.exp2(m_1 - m_safe)
                    o0 = o0 * a_0[None, :] + x_o.slice(0, CODE_BOX, dim=0).load(S_L) * a_1[None, :]
                    o1 = o1 * a_0[None, :] + x_o.slice(CODE_BOX, CODE_BOX, dim=0).load(S_L) * a_1[None, :]
                    o2 = o2 * a_0[None, :] + x_o.slice(2 * CODE_BOX, CODE_BOX, dim=0).load(S_L) * a_1[None, :]
                    o3 = o3 * a_0[None, :] + x_o.slice(3 * CODE_BOX, CODE_BOX, dim=0).load(S_L) * a_1[None, :]
                    l_i = l_i * a_0 + l_1 * a_1
                    m_i = m_new
                    mbarrier.arrive(sync.index(3))
            if WG == 0:
                # ---- registers -> HBM: the normalised output (one split) or partial, and the lse.
                has_keys = l_i != 0             # NaN counts as keys: a NaN score reaches out and lse
                inv = 1.0 / gl.where(has_keys, l_i, 1.0)
                _store_group(o0 * inv[None, :], 0, pid_h, req, part_idx, n_part, rows_total, h_q, out_ptr, oacc_ptr,
                             stride_ob, stride_os, stride_oh, S_L, BLOCK_H)
                _store_group(o1 * inv[None, :], 1, pid_h, req, part_idx, n_part, rows_total, h_q, out_ptr, oacc_ptr,
                             stride_ob, stride_os, stride_oh, S_L, BLOCK_H)
                _store_group(o2 * inv[None, :], 2, pid_h, req, part_idx, n_part, rows_total, h_q, out_ptr, oacc_ptr,
                             stride_ob, stride_os, stride_oh, S_L, BLOCK_H)
                _store_group(o3 * inv[None, :], 3, pid_h, req, part_idx, n_part, rows_total, h_q, out_ptr, oacc_ptr,
                             stride_ob, stride_os, stride_oh, S_L, BLOCK_H)
                _ws_store_lse(gl.where(has_keys, m_i + gl.log2(gl.where(has_keys, l_i, 1.0)), float("-inf")), rows,
                              req, part_idx, n_part, rows_total, h_q, lse_ptr, lseacc_ptr, stride_lb, stride_lh)
            j += 1


@gluon.jit
def fp8_rs_body(q_ptr, codes_desc, scales_desc, bt_ptr, seqlens_ptr, meta_ptr, splits_ptr, out_ptr, lse_ptr, oacc_ptr,
                lseacc_ptr, batch, h_q, s_q, rows_total, num_slots, num_blocks, max_tokens, qk_scale, stride_qb,
                stride_qs, stride_qh, stride_btb, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, pid_h,
                slot_first, slot_last, CAUSAL: gl.constexpr, BLOCK_H: gl.constexpr, STAGES: gl.constexpr,
                KV_PAGE: gl.constexpr, SLOT_N: gl.constexpr, SKIP: gl.constexpr, WGS: gl.constexpr):
    """The register-operand form: shared memory (Q, the ring, four P_g^T per MMA warpgroup, WG 1's
    exchange buffers) and barriers, then the ``WGS`` MMA warpgroups (WG 0: the default partition)
    and the producer."""
    gl.static_assert(SLOT_N == BLOCK_N, "the register-operand form's ring slots are 64-token tiles")
    dtype: gl.constexpr = gl.float16             # Q's 512-wide part, the converted codes, P_g
    rope_t: gl.constexpr = q_ptr.dtype.element_ty  # bf16: the cache's RoPE part and Q's
    q_nope = gl.allocate_shared_memory(dtype, [BLOCK_H, D_NOPE],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_NOPE], dtype))
    q_rope = gl.allocate_shared_memory(rope_t, [BLOCK_H, D_ROPE],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_ROPE], rope_t))
    codes_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES * CODE_BOXES, BLOCK_N, CODE_BOX], codes_desc.layout)
    rope_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, CODE_BOX], codes_desc.layout)
    scales_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N, SCALES], scales_desc.layout)
    p_t = gl.allocate_shared_memory(dtype, [WGS * CODE_BOXES, BLOCK_H, BLOCK_N],
                                    gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype))
    # WG 1's O^T, row max and row sum for WG 0 (with one warpgroup: one row, unused)
    x_o = gl.allocate_shared_memory(gl.float32, [D_NOPE if WGS == 2 else 1, BLOCK_H], FLAT)
    x_ml = gl.allocate_shared_memory(gl.float32, [BLOCK_N if WGS == 2 else 1, BLOCK_H], FLAT)
    sync = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    r_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    r_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(r_ready.index(i), count=1)
        mbarrier.init(r_empty.index(i), count=1)
    for i in gl.static_range(4):
        mbarrier.init(sync.index(i), count=1)
    fence_async_shared()

    # (argument tuples written out in the call: a tuple held in a variable loses its constexprs)
    if WGS == 2:
        gl.warp_specialize([
            (fp8_rs_mma, (q_ptr, q_nope, q_rope, codes_ring, rope_ring, scales_ring, p_t, r_ready, r_empty, x_o, x_ml,
                          sync, meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot_first, slot_last,
                          pid_h, h_q, s_q, qk_scale, rows_total, out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, stride_qb,
                          stride_qs, stride_qh, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, CAUSAL, BLOCK_H,
                          STAGES, SKIP, WGS, 0)),
            (fp8_rs_mma, (q_ptr, q_nope, q_rope, codes_ring, rope_ring, scales_ring, p_t, r_ready, r_empty, x_o, x_ml,
                          sync, meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot_first, slot_last,
                          pid_h, h_q, s_q, qk_scale, rows_total, out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, stride_qb,
                          stride_qs, stride_qh, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, CAUSAL, BLOCK_H,
                          STAGES, SKIP, WGS, 1)),
            (fp8_ws_producer, (codes_desc, scales_desc, codes_ring, rope_ring, scales_ring, r_ready, r_empty, bt_ptr,
                               stride_btb, meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, num_blocks,
                               slot_first, slot_last, STAGES, KV_PAGE, SLOT_N)),
        ], [4, 1], [232, 40])
    else:
        gl.warp_specialize([
            (fp8_rs_mma, (q_ptr, q_nope, q_rope, codes_ring, rope_ring, scales_ring, p_t, r_ready, r_empty, x_o, x_ml,
                          sync, meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot_first, slot_last,
                          pid_h, h_q, s_q, qk_scale, rows_total, out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, stride_qb,
                          stride_qs, stride_qh, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, CAUSAL, BLOCK_H,
                          STAGES, SKIP, WGS, 0)),
            (fp8_ws_producer, (codes_desc, scales_desc, codes_ring, rope_ring, scales_ring, r_ready, r_empty, bt_ptr,
                               stride_btb, meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, num_blocks,
                               slot_first, slot_last, STAGES, KV_PAGE, SLOT_N)),
        ], [1], [40])
