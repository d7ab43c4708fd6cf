"""Gluon MLA split kernel for Hopper: KV pages through a TMA + mbarrier ring filled by a producer
warp, WGMMA on both products, two consumer warpgroups with separate roles.

What it adds over the ``tl`` kernels of ``kernels.py`` (same metadata, same partials, same combine):

* KV tiles arrive by TMA (the bulk copy engine) into a ring of ``STAGES`` shared-memory buffers,
  each with its own mbarrier: the copy of the next tile runs while the tensor cores work on the
  current one, with no consumer thread spending registers or issue slots on loads (``tl``'s
  cp.async path waits for every copy at 2 stages, so its loads and MMAs take turns).
* Q stays in shared memory for the whole split (64 rows x 576, WGMMA's A operand); the scores go
  straight from the WGMMA accumulator into the online softmax; MLA's V is the same
  shared-memory tile as K's first 512 columns.
* The two warpgroups share P V by output columns (each a [64, 256] fp32 accumulator, 128
  registers per thread). Two schedules of S and the softmax (``SEESAW``):
  - role split (the default): one warpgroup computes every S and softmax, so no row max or sum
    crosses warpgroups; its softmax leaves the tensor cores to the other warpgroup's half of P V;
  - seesaw: the warpgroups take the tiles in turn (S, softmax, P handoff), passing the running
    row max from one to the other, so one warpgroup's softmax runs under the other's WGMMAs.

One program per (64-row head tile, slot); split requests write partials that
``kernels.mla_combine_kernel`` merges in a second launch. Rows past ``s_q * h_q`` are computed as
zeros and never stored.

Cache slots past a request's length may hold anything (NaN included): a TMA copy moves whole
tiles, so the rows of the last tile past the length are zeroed in shared memory before the
tensor cores read them (a masked score alone would still let ``0 * NaN`` into P V).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tilefuse.ops.gluon_compat import (fence_async_shared, mbarrier, thread_barrier, tma_load, warpgroup_mma,
                                       warpgroup_mma_wait)
from tilefuse.ops.mla.reference import HEAD_DIM, HEAD_DIM_V, PAGE_SIZE

PAGE = gl.constexpr(PAGE_SIZE)
D_NOPE = gl.constexpr(HEAD_DIM_V)              # K's latent part and all of V
D_ROPE = gl.constexpr(HEAD_DIM - HEAD_DIM_V)   # K's RoPE part
BLOCK_H = gl.constexpr(64)                     # query rows per program: WGMMA's M
LN2 = gl.constexpr(0.6931471805599453)
# A consumer warpgroup's half of O: [64, 256] fp32 as WGMMA accumulates it (128 registers per
# thread), its rows, and P as WGMMA's register A operand against it.
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, HEAD_DIM_V // 2, 16]))
ROWS_O = gl.constexpr(gl.SliceLayout(1, O_LAYOUT))
P_OPERAND = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2))
# The seesaw issues Q_nope K_nope^T as 8 WGMMAs of K = 64: the compiler then materializes their
# SMEM descriptors at the issue instead of holding all 32 of one K = 512 WGMMA in registers across
# the loop (spills measured at sm_90a: 280 -> 152 bytes per thread).
S_CHUNKS = gl.constexpr(8)
FIRST = gl.constexpr(0)                        # the seesaw consumers' indices (constexpr arguments)
SECOND = gl.constexpr(1)


@gluon.jit
def _split_range(meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot):
    """The work of ``slot``: (valid, request, first token, end token, length, partials of the
    request, this split's partial index). The same schedule as ``kernels._slot_work`` with one
    program per slot: the length from ``cache_seqlens`` (clamped to the block table), the split
    count and first slot from ``num_splits`` (checked before any arithmetic)."""
    row = meta_ptr + slot * 8
    req = gl.load(row)
    split = gl.load(row + 1)
    valid = (req >= 0) & (req < batch)
    req = gl.where(valid, req, 0)
    first = gl.load(splits_ptr + req)
    nxt = gl.load(splits_ptr + req + 1)
    valid = valid & (first >= 0) & (first < nxt) & (nxt <= num_slots)
    n = gl.where(valid, nxt - first, 1)
    valid = valid & (split >= 0) & (split < n)
    length = gl.minimum(gl.maximum(gl.load(seqlens_ptr + req), 0), max_tokens)
    pages = (length + PAGE - 1) // PAGE
    per = (pages + n - 1) // n
    begin = gl.minimum(split * per, pages)
    end = gl.minimum(begin + per, pages)
    return valid, req, begin * PAGE, gl.minimum(end * PAGE, length), length, n, first + split


@gluon.jit
def _issue_tile(kn_desc, kr_desc, kn_ring, kr_ring, bars, bt_row, tok_begin, j, last_page, num_blocks,
                pred, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, KV_PAGE: gl.constexpr):
    """HBM -> SMEM: TMA copies of tile ``j`` (tokens ``tok_begin + j BLOCK_N ..``) into ring slot
    ``j % STAGES``; its mbarrier flips when all bytes have landed. Pages come from the block
    table (column clamped to the split's last page, entry clamped to the cache): a tile within
    one cache page of ``KV_PAGE >= BLOCK_N`` tokens is one box per part; with smaller pages the
    tile's ``BLOCK_N / KV_PAGE`` pages land as boxes of ``KV_PAGE`` rows side by side."""
    BOX: gl.constexpr = KV_PAGE if KV_PAGE < BLOCK_N else BLOCK_N
    start = tok_begin + j * BLOCK_N
    s = j % STAGES
    bar = bars.index(s)
    mbarrier.expect(bar, (BLOCK_N // BOX) * (kn_desc.block_type.nbytes + kr_desc.block_type.nbytes), pred=pred)
    for sub in gl.static_range(BLOCK_N // BOX):
        token = start + sub * BOX
        page = gl.load(bt_row + gl.minimum(token // KV_PAGE, last_page), mask=pred, other=0)
        page = gl.minimum(gl.maximum(page, 0), num_blocks - 1)
        row = page * KV_PAGE + token % KV_PAGE
        if BOX == BLOCK_N:
            tma_load(kn_desc, [row, 0], bar, kn_ring.index(s), pred=pred)
            tma_load(kr_desc, [row, 0], bar, kr_ring.index(s), pred=pred)
        else:
            tma_load(kn_desc, [row, 0], bar, kn_ring.index(s).slice(sub * BOX, BOX, dim=0), pred=pred)
            tma_load(kr_desc, [row, 0], bar, kr_ring.index(s).slice(sub * BOX, BOX, dim=0), pred=pred)


@gluon.jit
def _zero_rows_past(tile, start, length, BLOCK_N: gl.constexpr, WIDTH: gl.constexpr, LAYOUT: gl.constexpr,
                    COLS: gl.constexpr):
    """SMEM -> registers -> SMEM: rows of a ``[BLOCK_N, WIDTH]`` tile at positions >= length set to
    0, ``COLS`` columns at a time (whatever the cache held there, NaN included)."""
    pos = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LAYOUT))
    keep = (pos < length)[:, None]
    for c in gl.static_range(0, WIDTH, COLS):
        part = tile.slice(c, COLS, dim=1)
        v = part.load(LAYOUT)
        part.store(gl.where(keep, v, gl.zeros_like(v)))


@gluon.jit
def _issue_scores(q_nope, q_rope, kn_ring, kr_ring, k_ready, tok_begin, j, length, stages,
                   BLOCK_N: gl.constexpr, CHUNKS: gl.constexpr = 1):
    """SMEM -> tensor cores: S_j = Q K_j^T ([64, 576] x [576, BLOCK_N], both operands in SMEM)
    issued asynchronously, once tile j has landed in slot ``j % stages`` (its rows past the
    request's end zeroed first); Q_nope K_nope^T as CHUNKS WGMMAs over slices of K. Returned
    through a wait that lets them all run on (callers' branches then agree on its type); read it
    only after a real wait."""
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    stage = j % stages
    start = tok_begin + j * BLOCK_N
    kn = kn_ring.index(stage)
    kr = kr_ring.index(stage)
    mbarrier.wait(k_ready.index(stage), (j // stages) & 1)
    if start + BLOCK_N > length:      # the request's last tile: clear the rows past its end
        _zero_rows_past(kn, start, length, BLOCK_N, D_NOPE, LOAD, 128)
        _zero_rows_past(kr, start, length, BLOCK_N, D_ROPE, LOAD, D_ROPE)
        fence_async_shared()
        thread_barrier()
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_LAYOUT)
    if CHUNKS == 1:
        s = warpgroup_mma(q_nope, kn.permute((1, 0)), s, use_acc=False, is_async=True)
    else:
        s = warpgroup_mma(q_nope.slice(0, D_NOPE // CHUNKS, dim=1),
                          kn.slice(0, D_NOPE // CHUNKS, dim=1).permute((1, 0)), s, use_acc=False, is_async=True)
        for c in gl.static_range(1, CHUNKS):
            s = warpgroup_mma(q_nope.slice(c * (D_NOPE // CHUNKS), D_NOPE // CHUNKS, dim=1),
                              kn.slice(c * (D_NOPE // CHUNKS), D_NOPE // CHUNKS, dim=1).permute((1, 0)), s,
                              is_async=True)
    s = warpgroup_mma(q_rope, kr.permute((1, 0)), s, is_async=True)
    return warpgroup_mma_wait(CHUNKS + 1, deps=(s,))


# ---------------------------------------------------------------------------------------------
# Warp-specialized form: a producer warp and two consumer warpgroups that hand P over.
#
#   producer (1 warp)     TMA: tile j -> ring slot j % 2, once both consumers released it
#   softmax WG (4 warps)  S_j = Q K_j^T, online softmax, P_j and its row factors -> SMEM,
#                         O[:, :256] = O alpha + P_j V_j[:, :256]      (P from registers)
#   PV WG (4 warps)       O[:, 256:] = O alpha + P_j V_j[:, 256:]      (P from SMEM)
#
# The PV warpgroup's product for tile j runs while the softmax warpgroup computes S_{j+1}: the
# tensor cores see the two warpgroups' WGMMAs interleaved, and each warpgroup holds a 64 x 256
# accumulator (128 registers per thread) instead of sharing one across eight warps.
# mbarriers: k_ready[s] (TMA bytes landed), k_empty[s] (both consumers done with slot s: count 2),
# p_ready / p_empty (the single P buffer), done (final row sums for the PV warpgroup).


@gluon.jit
def _ws_producer(kn_desc, kr_desc, kn_ring, kr_ring, k_ready, k_empty, bt_row, tok_begin, n_tiles, last_page,
                 num_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, KV_PAGE: gl.constexpr):
    for j in range(n_tiles):
        # slot j % STAGES is free once both consumers released tile j - STAGES (a fresh barrier
        # passes the parity-1 wait: the first round finds every slot free)
        mbarrier.wait(k_empty.index(j % STAGES), ((j // STAGES) & 1) ^ 1)
        _issue_tile(kn_desc, kr_desc, kn_ring, kr_ring, k_ready, bt_row, tok_begin, j, last_page, num_blocks,
                    True, BLOCK_N, STAGES, KV_PAGE)


@gluon.jit
def _ws_store_half(o, rows, cols, req, part_idx, n_part, rows_total, h_q, out_ptr, oacc_ptr,
                   stride_ob, stride_os, stride_oh):
    """registers -> HBM: a [64, 256] half of the normalised output, final or partial."""
    ok = (rows < rows_total)[:, None]
    if n_part == 1:
        ptrs = out_ptr + req * stride_ob + (rows // h_q)[:, None] * stride_os + (rows % h_q)[:, None] * stride_oh
        gl.store(ptrs + cols[None, :], o.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        gl.store(oacc_ptr + (part_idx * rows_total + rows)[:, None] * D_NOPE + cols[None, :], o, mask=ok)


@gluon.jit
def _softmax_start(pid_h, h_q, s_q, limit_base, CAUSAL: gl.constexpr, ROWS_S: gl.constexpr):
    """A softmax warpgroup's starting state: its 64 query rows, the last key position each may
    see (causal: query token t of s_q sees keys up to L - s_q + t), the running max and sum, and
    a zero [64, 256] half of O."""
    rows_s = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROWS_S)
    limit = limit_base - gl.where(CAUSAL, s_q - 1 - rows_s // h_q, 0)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROWS_S)
    l_i = gl.zeros([BLOCK_H], gl.float32, ROWS_S)
    return rows_s, limit, m_i, l_i, gl.zeros([BLOCK_H, D_NOPE // 2], gl.float32, O_LAYOUT)


@gluon.jit
def _ws_store_lse(lse2, rows, req, part_idx, n_part, rows_total, h_q, lse_ptr, lseacc_ptr, stride_lb, stride_lh):
    """registers -> HBM: the rows' log-sum-exp (log2 domain in, natural log out; -inf: no key
    seen, stored as +inf), final or partial."""
    row_ok = rows < rows_total
    if n_part == 1:
        lse = gl.where(lse2 == float("-inf"), float("inf"), lse2 * LN2)
        gl.store(lse_ptr + req * stride_lb + (rows % h_q) * stride_lh + rows // h_q, lse, mask=row_ok)
    else:
        gl.store(lseacc_ptr + part_idx * rows_total + rows, lse2, mask=row_ok)


@gluon.jit
def _ws_softmax(q_nope, q_rope, kn_ring, kr_ring, p_buf, alpha_buf, l_buf, k_ready, k_empty, p_ready, p_empty,
                done, tok_begin, n_tiles, length, limit_base, pid_h, h_q, s_q, qk_scale, req, part_idx, n_part,
                rows_total, out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, stride_ob, stride_os, stride_oh, stride_lb,
                stride_lh, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    dtype: gl.constexpr = q_nope.dtype
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    ROWS_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)

    rows_s, limit, m_i, l_i, acc = _softmax_start(pid_h, h_q, s_q, limit_base, CAUSAL, ROWS_S)
    for j in range(n_tiles):
        stage = j % STAGES
        start = tok_begin + j * BLOCK_N
        kn = kn_ring.index(stage)
        # ---- S = Q K^T: [64, 576] x [576, BLOCK_N], both operands in SMEM.
        s = _issue_scores(q_nope, q_rope, kn_ring, kr_ring, k_ready, tok_begin, j, length, STAGES, BLOCK_N)
        s = warpgroup_mma_wait(0, deps=(s,))
        # ---- online softmax in registers (each row within one warp: shuffles, no SMEM).
        pos = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        s = gl.where(pos[None, :] <= limit[:, None], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None]).to(dtype)
        l_i = l_i * alpha + gl.sum(p.to(gl.float32), axis=1)
        m_i = m_new
        # ---- hand P_j and alpha_j to the PV warpgroup (registers -> SMEM), once it took P_{j-1}.
        mbarrier.wait(p_empty, (j & 1) ^ 1)
        p_buf.store(p)
        alpha_buf.store(alpha)
        fence_async_shared()
        mbarrier.arrive(p_ready)
        # ---- O[:, :256] = O alpha + P V[:, :256]: P from registers, V from the ring slot.
        acc = acc * gl.convert_layout(alpha, ROWS_O)[:, None]
        acc = warpgroup_mma(gl.convert_layout(p, P_OPERAND), kn.slice(0, D_NOPE // 2, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(k_empty.index(stage))

    # ---- epilogue: row sums to the PV warpgroup, then this half of the output and the lse.
    has_keys = l_i != 0                     # NaN counts as keys: a NaN score reaches out and lse
    l_safe = gl.where(has_keys, l_i, 1.0)
    lse2 = gl.where(has_keys, m_i + gl.log2(l_safe), float("-inf"))
    l_buf.store(l_safe)
    mbarrier.arrive(done)
    rows_o = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROWS_O)
    cols = gl.arange(0, D_NOPE // 2, layout=gl.SliceLayout(0, O_LAYOUT))
    _ws_store_half(acc / gl.convert_layout(l_safe, ROWS_O)[:, None], rows_o, cols, req, part_idx, n_part,
                   rows_total, h_q, out_ptr, oacc_ptr, stride_ob, stride_os, stride_oh)
    _ws_store_lse(lse2, rows_s, req, part_idx, n_part, rows_total, h_q, lse_ptr, lseacc_ptr, stride_lb, stride_lh)


@gluon.jit
def _ws_pv(kn_ring, p_buf, alpha_buf, l_buf, k_ready, k_empty, p_ready, p_empty, done, n_tiles, pid_h, h_q, req,
           part_idx, n_part, rows_total, out_ptr, oacc_ptr, stride_ob, stride_os, stride_oh,
           STAGES: gl.constexpr):
    acc = gl.zeros([BLOCK_H, D_NOPE // 2], gl.float32, O_LAYOUT)
    for j in range(n_tiles):
        stage = j % STAGES
        mbarrier.wait(k_ready.index(stage), (j // STAGES) & 1)
        mbarrier.wait(p_ready, j & 1)
        # ---- O[:, 256:] = O alpha + P V[:, 256:]: P and alpha from SMEM (the softmax WG's).
        acc = acc * alpha_buf.load(ROWS_O)[:, None]
        acc = warpgroup_mma(p_buf, kn_ring.index(stage).slice(D_NOPE // 2, D_NOPE // 2, dim=1), acc,
                            is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(p_empty)
        mbarrier.arrive(k_empty.index(stage))
    mbarrier.wait(done, 0)
    rows_o = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROWS_O)
    cols = D_NOPE // 2 + gl.arange(0, D_NOPE // 2, layout=gl.SliceLayout(0, O_LAYOUT))
    _ws_store_half(acc / l_buf.load(ROWS_O)[:, None], rows_o, cols, req, part_idx, n_part, rows_total, h_q,
                   out_ptr, oacc_ptr, stride_ob, stride_os, stride_oh)


# ---------------------------------------------------------------------------------------------
# Seesaw form: the two consumer warpgroups take the tiles in turn.
#
#   warpgroup w (w = 0, 1) owns tiles j = w, w + 2, ... and holds O[:, 256 w : 256 w + 256].
#   For its tile j it issues S_j = Q K_j^T, then applies the other warpgroup's tile j - 1 to its
#   half of O (P_{j-1} and alpha_{j-1} loaded from SMEM) while S_j runs; takes the running row
#   max m_{j-1} the other published, computes the softmax of tile j and publishes m_j, then P_j
#   and alpha_j; then applies tile j to its half (P from registers).
#
# While one warpgroup runs exp2 and row sums, the tensor cores hold the other's S and P V. The
# single P buffer is written by the warpgroups in turn, each after it has loaded the previous P
# (the other's) into registers, so no "P empty" barrier is needed; m_buf likewise. Row sums are
# kept per warpgroup (each rescaled by every tile's alpha, in tile order) and added at the end.
# Registers: 240 per consumer thread; ptxas still spills ~150 bytes (WGMMA descriptors, reloaded
# from L1 around the S issue).
# mbarriers: k_ready[s], k_empty[s] (count 2: both warpgroups read every tile's V), m_ready
# (m_j published), p_ready (P_j, alpha_j published), done (count 2: both row-sum parts written).


@gluon.jit
def _seesaw_other_tile(acc, l_i, kn_ring, p_buf, alpha_buf, k_ready, p_ready, j, stages, W: gl.constexpr):
    """SMEM -> registers -> tensor cores: the other warpgroup's tile j on this half of O, issued
    asynchronously (O alpha_j + P_j V_j[:, half], P_j loaded into registers); the row sum
    rescaled by alpha_j."""
    stage = j % stages
    mbarrier.wait(k_ready.index(stage), (j // stages) & 1)
    mbarrier.wait(p_ready, j & 1)
    alpha = alpha_buf.load(ROWS_O)
    acc = acc * alpha[:, None]
    l_i = l_i * gl.convert_layout(alpha, l_i.type.layout)
    p = p_buf.load(P_OPERAND)
    acc = warpgroup_mma(p, kn_ring.index(stage).slice(W * (D_NOPE // 2), D_NOPE // 2, dim=1), acc, is_async=True)
    return acc, l_i


@gluon.jit
def _seesaw_consumer(q_nope, q_rope, kn_ring, kr_ring, p_buf, alpha_buf, m_buf, l_buf, k_ready, k_empty, m_ready,
                     p_ready, done, tok_begin, n_tiles, length, limit_base, pid_h, h_q, s_q, qk_scale, req, part_idx,
                     n_part, rows_total, out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, stride_ob, stride_os, stride_oh,
                     stride_lb, stride_lh, W: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr):
    dtype: gl.constexpr = q_nope.dtype
    HALF: gl.constexpr = D_NOPE // 2
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    ROWS_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)

    rows_s, limit, m_i, l_i, acc = _softmax_start(pid_h, h_q, s_q, limit_base, CAUSAL, ROWS_S)
    # The ring depth as a run-time value (req >= 0, read from the schedule): with STAGES = 2 a
    # warpgroup's tiles all sit in one slot, and a constant slot lets the compiler hoist that
    # slot's 36 WGMMA descriptors of K out of the loop next to Q's 36, which spills; a run-time
    # slot keeps them computed per tile.
    stages = STAGES + (req < 0).to(gl.int32)
    for j in range(W, n_tiles, 2):
        stage = j % stages
        # ---- S_j issued; the other warpgroup's tile j - 1 on this half issued behind it.
        s = _issue_scores(q_nope, q_rope, kn_ring, kr_ring, k_ready, tok_begin, j, length, stages, BLOCK_N, S_CHUNKS)
        if j > 0:
            acc, l_i = _seesaw_other_tile(acc, l_i, kn_ring, p_buf, alpha_buf, k_ready, p_ready, j - 1, stages, W)
            acc, s = warpgroup_mma_wait(0, deps=(acc, s))
            mbarrier.arrive(k_empty.index((j - 1) % stages))
        else:
            s = warpgroup_mma_wait(0, deps=(s,))
        # ---- softmax of tile j from the running max of tile j - 1 (the other warpgroup's).
        m_prev = m_i
        if j > 0:
            mbarrier.wait(m_ready, (j - 1) & 1)
            m_prev = m_buf.load(ROWS_S)
        pos = tok_begin + j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        s = gl.where(pos[None, :] <= limit[:, None], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_prev, gl.max(s, axis=1))
        m_buf.store(m_new)                    # published first: the other warpgroup's next softmax
        mbarrier.arrive(m_ready)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_prev - m_safe)
        p = gl.exp2(s - m_safe[:, None]).to(dtype)
        l_i = l_i * alpha + gl.sum(p.to(gl.float32), axis=1)
        m_i = m_new
        # ---- P_j and alpha_j to the other warpgroup (registers -> SMEM; P_{j-1} was loaded above).
        p_buf.store(p)
        alpha_buf.store(alpha)
        mbarrier.arrive(p_ready)
        # ---- this warpgroup's half of tile j: O alpha_j + P_j V_j[:, half] (P from registers).
        acc = acc * gl.convert_layout(alpha, ROWS_O)[:, None]
        acc = warpgroup_mma(gl.convert_layout(p, P_OPERAND), kn_ring.index(stage).slice(W * HALF, HALF, dim=1), acc,
                            is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(k_empty.index(stage))
    if n_tiles > 0 and (n_tiles + 1) % 2 != W:    # the last tile is the other warpgroup's
        acc, l_i = _seesaw_other_tile(acc, l_i, kn_ring, p_buf, alpha_buf, k_ready, p_ready, n_tiles - 1, stages, W)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(k_empty.index((n_tiles - 1) % stages))

    # ---- epilogue: the row sums add up across warpgroups; each stores its half of O; the owner
    # of the last tile (whose m_i is the final row max) stores the lse.
    l_buf.slice(W * BLOCK_H, BLOCK_H).store(l_i)
    mbarrier.arrive(done)
    mbarrier.wait(done, 0)
    l_tot = l_buf.slice(0, BLOCK_H).load(ROWS_S) + l_buf.slice(BLOCK_H, BLOCK_H).load(ROWS_S)
    has_keys = l_tot != 0                   # NaN counts as keys: a NaN score reaches out and lse
    l_safe = gl.where(has_keys, l_tot, 1.0)
    rows_o = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROWS_O)
    cols = W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, O_LAYOUT))
    _ws_store_half(acc / gl.convert_layout(l_safe, ROWS_O)[:, None], rows_o, cols, req, part_idx, n_part,
                   rows_total, h_q, out_ptr, oacc_ptr, stride_ob, stride_os, stride_oh)
    if (n_tiles + 1) % 2 == W:
        lse2 = gl.where(has_keys, m_i + gl.log2(l_safe), float("-inf"))
        _ws_store_lse(lse2, rows_s, req, part_idx, n_part, rows_total, h_q, lse_ptr, lseacc_ptr, stride_lb,
                      stride_lh)


@gluon.jit
def mla_split_ws_kernel(
    q_ptr, kn_desc, kr_desc, bt_ptr, seqlens_ptr, meta_ptr, splits_ptr,
    out_ptr, lse_ptr, oacc_ptr, lseacc_ptr,
    batch, h_q, s_q, rows_total, num_slots, num_blocks, max_tokens, qk_scale,
    stride_qb, stride_qs, stride_qh, stride_btb,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SEESAW: gl.constexpr,
    KV_PAGE: gl.constexpr, num_warps: gl.constexpr,
):
    """Attention of 64 query rows of one request over one split of its pages, on a producer warp
    and two consumer warpgroups (``num_warps = 4``: the default partition is the softmax
    warpgroup, or with ``SEESAW`` consumer 0; the other consumer and the producer are worker
    partitions).

    kn_desc / kr_desc: TMA descriptors over the cache as ``[num_blocks * KV_PAGE, 576]`` rows,
    boxes of ``min(KV_PAGE, BLOCK_N)`` rows: ``[., 512]`` (columns 0..511) and ``[., 64]``
    (columns 512..575). Scores in the
    log2 domain (``qk_scale = softmax_scale * log2(e)``)."""
    dtype: gl.constexpr = kn_desc.dtype
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    VEC: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    # The head tile is the grid's fastest axis: the tiles of one slot start together on
    # neighbouring SMs and stream the same KV pages, so the second reads them from L2.
    pid_h = gl.program_id(0)
    slot = gl.program_id(1)
    valid, req, tok_begin, tok_end, length, n_part, part_idx = _split_range(
        meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot)
    if not valid:
        return
    # ---- Q: HBM -> registers -> SMEM once (64 rows x 576; rows past s_q * h_q as 0).
    rows_l = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LOAD))
    q_rows = (q_ptr + req * stride_qb + (rows_l // h_q) * stride_qs + (rows_l % h_q) * stride_qh)[:, None]
    q_ok = (rows_l < rows_total)[:, None]
    cols_n = gl.arange(0, D_NOPE, layout=gl.SliceLayout(0, LOAD))[None, :]
    cols_r = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, LOAD))[None, :]
    q_nope = gl.allocate_shared_memory(dtype, [BLOCK_H, D_NOPE], kn_desc.layout,
                                       gl.load(q_rows + cols_n, mask=q_ok, other=0.0))
    q_rope = gl.allocate_shared_memory(dtype, [BLOCK_H, D_ROPE], kr_desc.layout,
                                       gl.load(q_rows + D_NOPE + cols_r, mask=q_ok, other=0.0))
    kn_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_NOPE], kn_desc.layout)
    kr_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_ROPE], kr_desc.layout)
    P_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(128, BLOCK_N * 2), element_bitwidth=16, rank=2)
    p_buf = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], P_SMEM)
    alpha_buf = gl.allocate_shared_memory(gl.float32, [BLOCK_H], VEC)
    m_buf = gl.allocate_shared_memory(gl.float32, [BLOCK_H], VEC)
    l_buf = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H], VEC)    # one row-sum part per consumer
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # role split: p_ready, p_empty, done; seesaw: m_ready, p_ready, done (both consumers arrive)
    sync = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
    for i in gl.static_range(3):
        mbarrier.init(sync.index(i), count=2 if SEESAW and i == 2 else 1)
    fence_async_shared()

    bt_row = bt_ptr + req * stride_btb
    last_page = gl.maximum(tok_end - 1, 0) // KV_PAGE
    n_tiles = (tok_end - tok_begin + BLOCK_N - 1) // BLOCK_N
    limit_base = length - 1
    # (argument tuples written out in the call: a tuple held in a variable loses its constexprs)
    if SEESAW:
        gl.warp_specialize([
            (_seesaw_consumer, (q_nope, q_rope, kn_ring, kr_ring, p_buf, alpha_buf, m_buf, l_buf, k_ready, k_empty,
                                sync.index(0), sync.index(1), sync.index(2), tok_begin, n_tiles, length, limit_base,
                                pid_h, h_q, s_q, qk_scale, req, part_idx, n_part, rows_total, out_ptr, lse_ptr,
                                oacc_ptr, lseacc_ptr, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, FIRST,
                                CAUSAL, BLOCK_N, STAGES)),
            (_seesaw_consumer, (q_nope, q_rope, kn_ring, kr_ring, p_buf, alpha_buf, m_buf, l_buf, k_ready, k_empty,
                                sync.index(0), sync.index(1), sync.index(2), tok_begin, n_tiles, length, limit_base,
                                pid_h, h_q, s_q, qk_scale, req, part_idx, n_part, rows_total, out_ptr, lse_ptr,
                                oacc_ptr, lseacc_ptr, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, SECOND,
                                CAUSAL, BLOCK_N, STAGES)),
            (_ws_producer, (kn_desc, kr_desc, kn_ring, kr_ring, k_ready, k_empty, bt_row, tok_begin, n_tiles, last_page,
                            num_blocks, BLOCK_N, STAGES, KV_PAGE)),
        ], [4, 1], [240, 24])
    else:
        gl.warp_specialize([
            (_ws_softmax, (q_nope, q_rope, kn_ring, kr_ring, p_buf, alpha_buf, l_buf.slice(0, BLOCK_H), k_ready,
                           k_empty, sync.index(0), sync.index(1), sync.index(2), tok_begin, n_tiles, length,
                           limit_base, pid_h, h_q, s_q, qk_scale, req, part_idx, n_part, rows_total, out_ptr, lse_ptr,
                           oacc_ptr, lseacc_ptr, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, CAUSAL,
                           BLOCK_N, STAGES)),
            (_ws_pv, (kn_ring, p_buf, alpha_buf, l_buf.slice(0, BLOCK_H), k_ready, k_empty, sync.index(0),
                      sync.index(1), sync.index(2), n_tiles, pid_h, h_q, req, part_idx, n_part, rows_total, out_ptr,
                      oacc_ptr, stride_ob, stride_os, stride_oh, STAGES)),
            (_ws_producer, (kn_desc, kr_desc, kn_ring, kr_ring, k_ready, k_empty, bt_row, tok_begin, n_tiles, last_page,
                            num_blocks, BLOCK_N, STAGES, KV_PAGE)),
        ], [4, 1], [232, 40])
