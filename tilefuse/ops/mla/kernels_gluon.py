"""Gluon MLA split kernel for Hopper: KV pages through a TMA + mbarrier ring filled by a producer
warp, WGMMA on both products, two consumer warpgroups with separate roles, one program per part of
the schedule running its splits back to back.

What it adds over the ``tl`` kernels of ``kernels.py`` (same metadata, same partials, same combine):

* KV tiles arrive by TMA (the bulk copy engine) into a ring of ``STAGES`` shared-memory buffers,
  each with its own mbarrier: the copy of the next tile runs while the tensor cores work on the
  current one, with no consumer thread spending registers or issue slots on loads (``tl``'s
  cp.async path waits for every copy at 2 stages, so its loads and MMAs take turns).
* Persistent over a run of splits: under the metadata's parts schedule (FlashMLA's) the batch's
  work is cut into equal parts, each a run of splits (whole short requests, pieces of long ones);
  a program runs its run's splits one after the other and the producer keeps filling the ring across a split's end,
  so the next split's first tiles land while the consumers finish the last one's output.
* Q stays in shared memory for the whole split (64 rows x 576, WGMMA's A operand), reloaded by
  the softmax warpgroup (its only reader) at each split; the scores go straight from the WGMMA
  accumulator into the online softmax; MLA's V is the same shared-memory tile as K's first 512
  columns.
* The two warpgroups share P V by output columns (each a [64, 256] fp32 accumulator, 128
  registers per thread); one warpgroup computes every S and softmax, so no row max or sum crosses
  warpgroups, and its softmax leaves the tensor cores to the other warpgroup's half of P V.

Grid: (64-row head tile, metadata row); program p runs the slots the metadata's column 7 gives
it (one slot, or a part's run of splits); split requests write partials that ``kernels.mla_combine_kernel``
merges in a second launch (a programmatic dependent launch: ``PDL``). Rows past ``s_q * h_q`` are
computed as zeros and never stored. Per-call levers behind switches (``configs.WGMMA_LEVERS``):
``PDL`` (on), a combine fused into the last split of each request (``FUSED_SPLITS``) and Q issued
ahead (``Q_AHEAD``), both off (measured slower or level: docs/design/mla.md).

Cache slots past a request's length may hold anything (NaN included): a TMA copy moves whole
tiles, so the rows of the last tile past the length are zeroed in shared memory before the
tensor cores read them (a masked score alone would still let ``0 * NaN`` into P V).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tilefuse.ops.gluon_compat import (cp_async, cp_commit, cp_wait, fence_async_shared, mbarrier, thread_barrier,
                                       tma_load, warpgroup_mma, warpgroup_mma_wait)
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


@gluon.jit
def _split_range(meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot):
    """The work of ``slot``: (valid, request, first token, end token, length, partials of the
    request, this split's partial index, the request's first partial). The same rule as ``kernels._slot_work`` with one
    program per slot: the length from ``cache_seqlens`` (clamped to the block table), the split
    count and first slot from ``num_splits`` (checked before any arithmetic), the planned pages
    clamped to the request's (split 0 from page 0, the last split to its last page)."""
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
    begin = gl.where(split == 0, 0, gl.minimum(gl.maximum(gl.load(row + 2), 0), pages))
    end = gl.where(split == n - 1, pages, gl.minimum(gl.maximum(gl.load(row + 3), begin), pages))
    return valid, req, begin * PAGE, gl.minimum(end * PAGE, length), length, n, first + split, first


@gluon.jit
def _program_run(meta_ptr, num_slots):
    """A split program's place in the grid: its head tile (axis 0) and its run of slots
    ``meta[p, 7] .. meta[p + 1, 7] - 1`` for ``p`` = axis 1, clamped to the metadata (an empty run
    when the column is out of order)."""
    run = gl.program_id(1)
    slot_first = gl.minimum(gl.maximum(gl.load(meta_ptr + run * 8 + 7), 0), num_slots)
    slot_last = gl.minimum(gl.maximum(gl.load(meta_ptr + (run + 1) * 8 + 7), slot_first), num_slots)
    return gl.program_id(0), slot_first, slot_last


@gluon.jit
def _issue_tile(kn_desc, kr_desc, kn_ring, kr_ring, bars, bt_row, start, s, last_page, num_blocks,
                BLOCK_N: gl.constexpr, KV_PAGE: gl.constexpr):
    """HBM -> SMEM: TMA copies of the tile of tokens ``start .. start + BLOCK_N - 1`` into ring
    slot ``s``; its mbarrier flips when all bytes have landed. Pages come from the block table
    (column clamped to the split's last page, entry clamped to the cache): a tile within one
    cache page of ``KV_PAGE >= BLOCK_N`` tokens is one box per part; with smaller pages the
    tile's ``BLOCK_N / KV_PAGE`` pages land as boxes of ``KV_PAGE`` rows side by side."""
    BOX: gl.constexpr = KV_PAGE if KV_PAGE < BLOCK_N else BLOCK_N
    bar = bars.index(s)
    mbarrier.expect(bar, (BLOCK_N // BOX) * (kn_desc.block_type.nbytes + kr_desc.block_type.nbytes))
    for sub in gl.static_range(BLOCK_N // BOX):
        token = start + sub * BOX
        page = gl.load(bt_row + gl.minimum(token // KV_PAGE, last_page))
        page = gl.minimum(gl.maximum(page, 0), num_blocks - 1)
        row = page * KV_PAGE + token % KV_PAGE
        if BOX == BLOCK_N:
            tma_load(kn_desc, [row, 0], bar, kn_ring.index(s))
            tma_load(kr_desc, [row, 0], bar, kr_ring.index(s))
        else:
            tma_load(kn_desc, [row, 0], bar, kn_ring.index(s).slice(sub * BOX, BOX, dim=0))
            tma_load(kr_desc, [row, 0], bar, kr_ring.index(s).slice(sub * BOX, BOX, dim=0))


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
def _gdc_wait():
    """Programmatic dependent launch: wait until the kernels this launch depends on have ended and
    their memory is visible (returns at once in a launch without PDL)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _gdc_launch_dependents():
    """Programmatic dependent launch: the next kernel of the stream (launched with PDL) may start
    once every program of this one has passed here or ended; it still waits for this one's end
    before it reads memory (``_gdc_wait``)."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _fence_gpu():
    """This thread's global stores ordered before its later memory operations at GPU scope."""
    gl.inline_asm_elementwise("fence.acq_rel.gpu; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _ws_arrive(cnt_ptr, counter, n_part):
    """A split's output and lse have been stored (the PV warpgroup's half by its threads, the
    softmax warpgroup's half and the lse before its ``o_stored`` arrival): bump the (request, head
    tile) counter (a partition barrier, then one acq_rel atomic: release of this split's partial,
    acquire of the others'). True for the split whose arrival completes ``n_part``; it re-arms the
    counter to 0 (the scratch stays zero)."""
    _fence_gpu()
    thread_barrier()
    last = gl.atomic_add(cnt_ptr + counter, 1, sem="acq_rel") == n_part - 1
    if last:
        gl.atomic_xchg(cnt_ptr + counter, 0, sem="relaxed")
    return last


@gluon.jit
def _ws_merge(req, pid_h, first, n_part, rows_total, h_q, out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, stride_ob,
              stride_os, stride_oh, stride_lb, stride_lh, MERGE_ROWS: gl.constexpr):
    """L2 -> registers -> HBM: the fused combine of a (request, head tile) from its ``n_part``
    partials ``first ..``: out = sum_s 2^(lse_s - lse) o_s, lse = log2 sum_s 2^lse_s (the largest
    lse subtracted first), as ``mla_combine_kernel`` computes it. ``MERGE_ROWS``: the tile's rows
    that can be valid (16, 32 or 64), read in ``[MERGE_ROWS, 4096 / MERGE_ROWS]`` chunks (32
    floats a thread), UNROLL partials in flight at once (the merge is bound by L2 latency)."""
    COLS: gl.constexpr = 4096 // MERGE_ROWS
    TPW_C: gl.constexpr = COLS // 4 if COLS < 128 else 32
    MERGE: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TPW_C, TPW_C], [4, 1], [1, 0])
    ROWS_M: gl.constexpr = gl.SliceLayout(1, MERGE)
    UNROLL: gl.constexpr = 2
    rows = pid_h * BLOCK_H + gl.arange(0, MERGE_ROWS, layout=ROWS_M)
    row_ok = rows < rows_total
    # ---- the largest lse of each row over the partials
    m = gl.full([MERGE_ROWS], float("-inf"), gl.float32, ROWS_M)
    for s0 in range(0, n_part, UNROLL):
        for u in gl.static_range(UNROLL):
            ok = row_ok & (s0 + u < n_part)
            m = gl.maximum(m, gl.load(lseacc_ptr + (first + s0 + u) * rows_total + rows, mask=ok,
                                      other=float("-inf"), cache_modifier=".cg"))
    m_safe = gl.where(m == float("-inf"), 0.0, m)
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, MERGE))
    out_rows = out_ptr + req * stride_ob + (rows // h_q) * stride_os + (rows % h_q) * stride_oh
    total = gl.zeros([MERGE_ROWS], gl.float32, ROWS_M)
    # ---- sum_s 2^(lse_s - m) o_s, a chunk of columns at a time
    for c in gl.static_range(0, D_NOPE, COLS):
        o = gl.zeros([MERGE_ROWS, COLS], gl.float32, MERGE)
        total = gl.zeros([MERGE_ROWS], gl.float32, ROWS_M)
        for s0 in range(0, n_part, UNROLL):
            for u in gl.static_range(UNROLL):
                ok = row_ok & (s0 + u < n_part)
                part = (first + s0 + u) * rows_total + rows
                w = gl.exp2(gl.load(lseacc_ptr + part, mask=ok, other=float("-inf"), cache_modifier=".cg") - m_safe)
                total += w
                o += w[:, None] * gl.load(oacc_ptr + part[:, None] * D_NOPE + c + cols[None, :], mask=ok[:, None],
                                          other=0.0, cache_modifier=".cg")
        t_safe = gl.where(total != 0, total, 1.0)
        gl.store(out_rows[:, None] + c + cols[None, :], (o / t_safe[:, None]).to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
    has_keys = total != 0
    lse2 = gl.where(has_keys, m_safe + gl.log2(gl.where(has_keys, total, 1.0)), float("-inf"))
    lse = gl.where(lse2 == float("-inf"), float("inf"), lse2 * LN2)
    gl.store(lse_ptr + req * stride_lb + (rows % h_q) * stride_lh + rows // h_q, lse, mask=row_ok)


# ---------------------------------------------------------------------------------------------
# Warp-specialized form: a producer warp and two consumer warpgroups that hand P over, all three
# walking the same run of splits (each computes every split's range from the metadata itself).
#
#   producer (1 warp)     TMA: tile t -> ring slot t % STAGES, once both consumers released it
#   softmax WG (4 warps)  per split: Q -> SMEM; per tile: S_t = Q K_t^T, online softmax, P_t and
#                         its row factors -> SMEM, O[:, :256] = O alpha + P_t V_t[:, :256]
#                         (P from registers); then row sums -> SMEM, its half of O and the lse
#   PV WG (4 warps)       per tile: O[:, 256:] = O alpha + P_t V_t[:, 256:] (P from SMEM); then
#                         its half of O
#
# t counts the program's tiles across splits, so the ring's slots and phases run on from one
# split to the next. The PV warpgroup's product for tile t runs while the softmax warpgroup
# computes S_{t+1}: the tensor cores see the two warpgroups' WGMMAs interleaved, and each
# warpgroup holds a 64 x 256 accumulator (128 registers per thread) instead of sharing one
# across eight warps. mbarriers: k_ready[s] (TMA bytes landed), k_empty[s] (both consumers done
# with slot s: count 2), p_ready / p_empty (the single P buffer), l_ready / l_free (a split's
# final row sums for the PV warpgroup, counted by splits).


@gluon.jit
def _ws_producer(kn_desc, kr_desc, kn_ring, kr_ring, k_ready, k_empty, bt_ptr, stride_btb, meta_ptr, splits_ptr,
                 seqlens_ptr, batch, num_slots, max_tokens, num_blocks, slot_first, slot_last,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, KV_PAGE: gl.constexpr, PDL: gl.constexpr):
    if PDL >= 2:      # (the default partition waited before the split; each reading partition waits too)
        _gdc_wait()
    t = 0
    for slot in range(slot_first, slot_last):
        valid, req, tok_begin, tok_end, length, n_part, part_idx, first = _split_range(
            meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot)
        if valid:
            bt_row = bt_ptr + req * stride_btb
            last_page = gl.maximum(tok_end - 1, 0) // KV_PAGE
            for start in range(tok_begin, tok_end, BLOCK_N):
                # slot t % STAGES is free once both consumers released tile t - STAGES (a fresh
                # barrier passes the parity-1 wait: the first round finds every slot free)
                mbarrier.wait(k_empty.index(t % STAGES), ((t // STAGES) & 1) ^ 1)
                _issue_tile(kn_desc, kr_desc, kn_ring, kr_ring, k_ready, bt_row, start, t % STAGES, last_page,
                            num_blocks, BLOCK_N, KV_PAGE)
                t += 1


@gluon.jit
def _load_q(q_ptr, q_nope, q_rope, req, pid_h, h_q, rows_total, stride_qb, stride_qs, stride_qh):
    """HBM -> SMEM: a split's 64 query rows (rows past ``s_q * h_q`` as 0) issued as cp.async
    copies, 64 columns at a time, one commit group (``_wait_q`` waits for it): no registers hold
    Q on the way, except where ``q_nope`` has another dtype than q (converted in registers). The
    op passes q with strides in multiples of 8 elements (16 bytes, cp.async's widest copy)."""
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LOAD))
    q_rows = (q_ptr + req * stride_qb + (rows // h_q) * stride_qs + (rows % h_q) * stride_qh)[:, None]
    ok = (rows < rows_total)[:, None]
    cols = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, LOAD))[None, :]
    for c in gl.static_range(0, D_NOPE + D_ROPE, D_ROPE):
        # each thread's 8 columns: 16 contiguous bytes at a 16-byte aligned address
        src = gl.max_contiguous(gl.multiple_of(q_rows + c + cols, [1, 16]), [1, 8])
        if c >= D_NOPE:
            cp_async(q_rope, src, mask=ok)
        elif q_nope.dtype == q_ptr.dtype.element_ty:
            cp_async(q_nope.slice(c, D_ROPE, dim=1), src, mask=ok)
        else:      # a K tile of another 16-bit type (an FP8 cache's fp16 codes): through registers
            q_nope.slice(c, D_ROPE, dim=1).store(gl.load(src, mask=ok, other=0.0).to(q_nope.dtype))
    cp_commit()


@gluon.jit
def _wait_q():
    """The split's Q copies (``_load_q``) landed: visible to this warpgroup's WGMMAs."""
    cp_wait(0)
    fence_async_shared()
    thread_barrier()


@gluon.jit
def _issue_scores_async(q_nope, q_rope, kn_ring, kr_ring, k_ready, start, t, length, BLOCK_N: gl.constexpr,
                        STAGES: gl.constexpr):
    """SMEM -> tensor cores: S = Q K^T ([64, 576] x [576, BLOCK_N], both operands in SMEM) for the
    program's tile ``t`` (tokens from ``start``) issued asynchronously, once it has landed in slot
    ``t % STAGES`` (its rows past the request's end zeroed first). Returns the in-flight
    accumulator: the caller waits for it."""
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    stage = t % STAGES
    kn = kn_ring.index(stage)
    kr = kr_ring.index(stage)
    mbarrier.wait(k_ready.index(stage), (t // STAGES) & 1)
    if start + BLOCK_N > length:      # the request's last tile: clear the rows past its end
        _zero_rows_past(kn, start, length, BLOCK_N, D_NOPE, LOAD, 128)
        _zero_rows_past(kr, start, length, BLOCK_N, D_ROPE, LOAD, D_ROPE)
        fence_async_shared()
        thread_barrier()
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_LAYOUT)
    s = warpgroup_mma(q_nope, kn.permute((1, 0)), s, use_acc=False, is_async=True)
    return warpgroup_mma(q_rope, kr.permute((1, 0)), s, is_async=True)


@gluon.jit
def _issue_scores(q_nope, q_rope, kn_ring, kr_ring, k_ready, start, t, length, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr):
    """``_issue_scores_async``, waited for: S in registers."""
    s = _issue_scores_async(q_nope, q_rope, kn_ring, kr_ring, k_ready, start, t, length, BLOCK_N, STAGES)
    return warpgroup_mma_wait(0, deps=(s,))


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
def _online_softmax(s, start, limit, m_prev, l_prev, qk_scale, BLOCK_N: gl.constexpr):
    """Online softmax of one tile's scores S ([64, BLOCK_N] fp32, WGMMA's accumulator layout; each
    row within one warp: shuffles, no SMEM): ``(p32, m_new, l_new, alpha)`` from the row max and
    sum after the previous tile, in the log2 domain (keys past ``limit`` score -inf). The row sum
    comes from the fp32 probabilities ``p32`` (the lse keeps fp32 accuracy; summing P after its
    rounding to K's dtype would put up to 2^-11 (fp16) on it); the caller rounds P for the tensor
    cores."""
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    pos = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
    s = gl.where(pos[None, :] <= limit[:, None], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_prev, gl.max(s, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_prev - m_safe)
    p32 = gl.exp2(s - m_safe[:, None])
    l_new = l_prev * alpha + gl.sum(p32, axis=1)
    return p32, m_new, l_new, alpha


@gluon.jit
def _ws_softmax(q_ptr, q_nope, q_rope, kn_ring, kr_ring, p_buf, alpha_buf, l_buf, k_ready, k_empty,
                p_ready, p_empty, l_ready, l_free, o_stored, meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens,
                slot_first, slot_last, pid_h, h_q, s_q, qk_scale, rows_total, out_ptr, lse_ptr, oacc_ptr,
                lseacc_ptr, stride_qb, stride_qs, stride_qh, stride_ob, stride_os, stride_oh, stride_lb,
                stride_lh, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                FUSED_SPLITS: gl.constexpr, Q_AHEAD: gl.constexpr):
    dtype: gl.constexpr = q_nope.dtype
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    ROWS_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    rows_s = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROWS_S)
    rows_o = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROWS_O)
    cols = gl.arange(0, D_NOPE // 2, layout=gl.SliceLayout(0, O_LAYOUT))
    t = 0                                  # the program's tiles so far (ring slot and phases)
    n_done = 0                             # its splits so far (l_ready / l_free phases)
    q_req = -1                             # Q_AHEAD: the request whose Q is in SMEM or on its way
    for slot in range(slot_first, slot_last):
        valid, req, tok_begin, tok_end, length, n_part, part_idx, first = _split_range(
            meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot)
        if valid:
            # ---- this split's Q (the last split's S products have all been waited for), unless
            # it was issued under the last split's final tile (Q_AHEAD)
            if q_req != req:
                _load_q(q_ptr, q_nope, q_rope, req, pid_h, h_q, rows_total, stride_qb, stride_qs, stride_qh)
            _wait_q()
            q_req = req
            # causal: query token r // h_q of s_q sees keys up to L - s_q + r // h_q
            limit = length - 1 - gl.where(CAUSAL, s_q - 1 - rows_s // h_q, 0)
            m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROWS_S)
            l_i = gl.zeros([BLOCK_H], gl.float32, ROWS_S)
            acc = gl.zeros([BLOCK_H, D_NOPE // 2], gl.float32, O_LAYOUT)
            for start in range(tok_begin, tok_end, BLOCK_N):
                # ---- S = Q K^T: [64, 576] x [576, BLOCK_N], both operands in SMEM.
                s = _issue_scores(q_nope, q_rope, kn_ring, kr_ring, k_ready, start, t, length, BLOCK_N, STAGES)
                s = warpgroup_mma_wait(0, deps=(s,))
                if Q_AHEAD:
                    # ---- the split's last S has read Q: issue the next split's Q now (under
                    # this tile's softmax, P V and the epilogue) when it is another request's
                    if (start + BLOCK_N >= tok_end) & (slot + 1 < slot_last):
                        n_valid, n_req, _b, _e, _l, _n, _p, _f = _split_range(
                            meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot + 1)
                        if n_valid & (n_req != req):
                            thread_barrier()      # every warp's S reads of Q are done
                            _load_q(q_ptr, q_nope, q_rope, n_req, pid_h, h_q, rows_total, stride_qb, stride_qs,
                                    stride_qh)
                            q_req = n_req
                # ---- online softmax in registers; P goes to the tensor cores in K's dtype.
                p32, m_i, l_i, alpha = _online_softmax(s, start, limit, m_i, l_i, qk_scale, BLOCK_N)
                p = p32.to(dtype)
                # ---- hand P_t and alpha_t to the PV warpgroup (registers -> SMEM), once it took P_{t-1}.
                mbarrier.wait(p_empty, (t & 1) ^ 1)
                p_buf.store(p)
                alpha_buf.store(alpha)
                fence_async_shared()
                mbarrier.arrive(p_ready)
                # ---- O[:, :256] = O alpha + P V[:, :256]: P from registers, V from the ring slot.
                acc = acc * gl.convert_layout(alpha, ROWS_O)[:, None]
                v_half = kn_ring.index(t % STAGES).slice(0, D_NOPE // 2, dim=1)
                acc = warpgroup_mma(gl.convert_layout(p, P_OPERAND), v_half, acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(k_empty.index(t % STAGES))
                t += 1
            # ---- epilogue: row sums to the PV warpgroup (once it read the last split's), then
            # this half of the output and the lse.
            has_keys = l_i != 0                 # NaN counts as keys: a NaN score reaches out and lse
            l_safe = gl.where(has_keys, l_i, 1.0)
            lse2 = gl.where(has_keys, m_i + gl.log2(l_safe), float("-inf"))
            mbarrier.wait(l_free, (n_done & 1) ^ 1)
            l_buf.store(l_safe)
            mbarrier.arrive(l_ready)
            _ws_store_half(acc / gl.convert_layout(l_safe, ROWS_O)[:, None], rows_o, cols, req, part_idx, n_part,
                           rows_total, h_q, out_ptr, oacc_ptr, stride_ob, stride_os, stride_oh)
            _ws_store_lse(lse2, rows_s, req, part_idx, n_part, rows_total, h_q, lse_ptr, lseacc_ptr, stride_lb,
                          stride_lh)
            if FUSED_SPLITS > 0:
                # ---- fused combine: this half and the lse are stored, fenced at GPU scope (the PV
                # warpgroup arrives for the split)
                _fence_gpu()
                mbarrier.arrive(o_stored)
            n_done += 1


@gluon.jit
def _ws_pv(kn_ring, p_buf, alpha_buf, l_buf, k_ready, k_empty, p_ready, p_empty, l_ready, l_free, o_stored, meta_ptr,
           splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot_first, slot_last, pid_h, h_q, rows_total,
           out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, cnt_ptr, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
           BLOCK_N: gl.constexpr, STAGES: gl.constexpr, FUSED_SPLITS: gl.constexpr, MERGE_ROWS: gl.constexpr,
           PDL: gl.constexpr):
    if PDL >= 2:
        _gdc_wait()
    rows_o = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROWS_O)
    cols = D_NOPE // 2 + gl.arange(0, D_NOPE // 2, layout=gl.SliceLayout(0, O_LAYOUT))
    t = 0
    n_done = 0
    for slot in range(slot_first, slot_last):
        valid, req, tok_begin, tok_end, length, n_part, part_idx, first = _split_range(
            meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot)
        if valid:
            acc = gl.zeros([BLOCK_H, D_NOPE // 2], gl.float32, O_LAYOUT)
            for start in range(tok_begin, tok_end, BLOCK_N):
                stage = t % STAGES
                mbarrier.wait(k_ready.index(stage), (t // STAGES) & 1)
                mbarrier.wait(p_ready, t & 1)
                # ---- O[:, 256:] = O alpha + P V[:, 256:]: P and alpha from SMEM (the softmax WG's).
                acc = acc * alpha_buf.load(ROWS_O)[:, None]
                acc = warpgroup_mma(p_buf, kn_ring.index(stage).slice(D_NOPE // 2, D_NOPE // 2, dim=1), acc,
                                    is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(p_empty)
                mbarrier.arrive(k_empty.index(stage))
                t += 1
            mbarrier.wait(l_ready, n_done & 1)
            l_safe = l_buf.load(ROWS_O)
            if FUSED_SPLITS == 0:
                mbarrier.arrive(l_free)
            _ws_store_half(acc / l_safe[:, None], rows_o, cols, req, part_idx, n_part, rows_total, h_q, out_ptr,
                           oacc_ptr, stride_ob, stride_os, stride_oh)
            if FUSED_SPLITS > 0:
                # ---- fused combine: once the softmax warpgroup stored its half and the lse, the
                # split arrives; the last of the request's splits to arrive merges the partials.
                # l_free only after o_stored: the softmax warpgroup's next o_stored arrival waits
                # for it, so o_stored never runs a phase ahead of this wait.
                mbarrier.wait(o_stored, n_done & 1)
                mbarrier.arrive(l_free)
                if (n_part > 1) & (n_part <= FUSED_SPLITS):
                    if _ws_arrive(cnt_ptr, req * 8 + pid_h, n_part):
                        _ws_merge(req, pid_h, first, n_part, rows_total, h_q, out_ptr, lse_ptr, oacc_ptr, lseacc_ptr,
                                  stride_ob, stride_os, stride_oh, stride_lb, stride_lh, MERGE_ROWS)
            n_done += 1


# ---- the seesaw form (SEESAW = 1, off: not yet measured): two symmetric MMA warpgroups. The
# split's tiles alternate between them (warpgroup 0 owns tiles 0, 2, ..., warpgroup 1 tiles 1, 3,
# ...); each keeps its half of O (columns 256 x ME ..) and, for every tile in order, adds that
# tile's P V half: its own tiles' P from registers, the other's from SMEM. The owner of tile j
# computes S_j and the softmax from the row max and sum after tile j - 1 (the other's), then
# publishes P_j, its alpha, max and sum. Each issues S of its next tile before it waits for the
# other's publication and runs its softmax while the other's P V half is on the tensor cores, so
# one warpgroup's softmax runs under the other's MMAs. One P tile and one set of row statistics
# suffice: a warpgroup overwrites them only after its own P V has read the other's (every tile's
# publication waits for the consumption of the one before it). mbarriers: pub[w] (warpgroup w
# published a tile), q_ready (warpgroup 0 loaded the split's Q), q_free (warpgroup 1 read it
# for the last time and consumed every P of the split).


@gluon.jit
def _seesaw_take(acc, kn_ring, p_buf, m_buf, l_buf, a_buf, k_ready, pub_other, n_other, t, ME: gl.constexpr,
                 STAGES: gl.constexpr, ROWS_S: gl.constexpr):
    """The other warpgroup's published tile (the program's tile ``t``), issued on this half of O:
    waits for its publication (and, as every reader of a slot does, for the slot's TMA bytes: long
    landed by then), reads its row statistics, rescales O by its alpha and issues ``O += P
    V[:, half]`` (P and V from SMEM) asynchronously. Returns ``(in-flight O, max, sum)``; the
    caller waits for O, then frees the slot."""
    stage = t % STAGES
    mbarrier.wait(pub_other, n_other & 1)
    mbarrier.wait(k_ready.index(stage), (t // STAGES) & 1)
    m_prev = m_buf.load(ROWS_S)
    l_prev = l_buf.load(ROWS_S)
    acc = acc * a_buf.load(ROWS_O)[:, None]
    v_half = kn_ring.index(stage).slice(ME * (D_NOPE // 2), D_NOPE // 2, dim=1)
    return warpgroup_mma(p_buf, v_half, acc, is_async=True), m_prev, l_prev


@gluon.jit
def _seesaw_wg(ME: gl.constexpr, q_ptr, q_nope, q_rope, kn_ring, kr_ring, p_buf, m_buf, l_buf, a_buf, k_ready,
               k_empty, pub_mine, pub_other, q_ready, q_free, meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots,
               max_tokens, slot_first, slot_last, pid_h, h_q, s_q, qk_scale, rows_total, out_ptr, lse_ptr, oacc_ptr,
               lseacc_ptr, stride_qb, stride_qs, stride_qh, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
               CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    dtype: gl.constexpr = q_nope.dtype
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    ROWS_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    rows_s = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROWS_S)
    t = 0              # the program's tiles so far, both warpgroups' (ring slot and phase)
    n_other = 0        # the other's tiles this warpgroup consumed (pub_other phases)
    n_split = 0        # splits so far (q_ready / q_free phases)
    for slot in range(slot_first, slot_last):
        valid, req, tok_begin, tok_end, length, n_part, part_idx, first = _split_range(
            meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot)
        if valid:
            # ---- the split's Q (HBM -> SMEM), loaded by warpgroup 0 once warpgroup 1 is done
            # with the last split's Q and P.
            if ME == 0:
                mbarrier.wait(q_free, (n_split & 1) ^ 1)
                _load_q(q_ptr, q_nope, q_rope, req, pid_h, h_q, rows_total, stride_qb, stride_qs, stride_qh)
                _wait_q()
                mbarrier.arrive(q_ready)
            else:
                mbarrier.wait(q_ready, n_split & 1)
            limit = length - 1 - gl.where(CAUSAL, s_q - 1 - rows_s // h_q, 0)
            m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROWS_S)
            l_i = gl.zeros([BLOCK_H], gl.float32, ROWS_S)
            acc = gl.zeros([BLOCK_H, D_NOPE // 2], gl.float32, O_LAYOUT)
            n_tiles = (tok_end - tok_begin + BLOCK_N - 1) // BLOCK_N
            for j in range(0, n_tiles):
                start = tok_begin + j * BLOCK_N
                if j % 2 == ME:
                    # ---- S_j = Q K_j^T issued first (the tensor cores run it while this
                    # warpgroup waits for the other's tile j - 1).
                    s_async = _issue_scores_async(q_nope, q_rope, kn_ring, kr_ring, k_ready, start, t, length,
                                                  BLOCK_N, STAGES)
                    if j > 0:
                        # ---- tile j - 1 (the other's): O half += P V from SMEM, in flight under
                        # this tile's softmax; the groups retire in order, so wait(1) is S_j.
                        pv, m_prev, l_prev = _seesaw_take(acc, kn_ring, p_buf, m_buf, l_buf, a_buf, k_ready,
                                                          pub_other, n_other, t - 1, ME, STAGES, ROWS_S)
                        s = warpgroup_mma_wait(1, deps=(s_async,))
                        p32, m_i, l_i, alpha = _online_softmax(s, start, limit, m_prev, l_prev, qk_scale, BLOCK_N)
                        acc = warpgroup_mma_wait(0, deps=(pv,))
                        mbarrier.arrive(k_empty.index((t - 1) % STAGES))
                        n_other += 1
                    else:
                        s = warpgroup_mma_wait(0, deps=(s_async,))
                        p32, m_i, l_i, alpha = _online_softmax(s, start, limit, m_i, l_i, qk_scale, BLOCK_N)
                    # ---- publish P_j and the rows' statistics (every warp of this warpgroup is
                    # past its reads of the last ones).
                    p = p32.to(dtype)
                    thread_barrier()
                    p_buf.store(p)
                    m_buf.store(m_i)
                    l_buf.store(l_i)
                    a_buf.store(alpha)
                    fence_async_shared()
                    mbarrier.arrive(pub_mine)
                    # ---- O half = O half alpha + P_j V_j[:, half] (P from registers).
                    acc = acc * gl.convert_layout(alpha, ROWS_O)[:, None]
                    v_half = kn_ring.index(t % STAGES).slice(ME * (D_NOPE // 2), D_NOPE // 2, dim=1)
                    acc = warpgroup_mma(gl.convert_layout(p, P_OPERAND), v_half, acc, is_async=True)
                    acc = warpgroup_mma_wait(0, deps=(acc,))
                    mbarrier.arrive(k_empty.index(t % STAGES))
                t += 1
            # ---- the split's last tile, when it is the other's
            if (n_tiles > 0) & ((n_tiles - 1) % 2 != ME):
                pv, m_i, l_i = _seesaw_take(acc, kn_ring, p_buf, m_buf, l_buf, a_buf, k_ready, pub_other, n_other,
                                            t - 1, ME, STAGES, ROWS_S)
                acc = warpgroup_mma_wait(0, deps=(pv,))
                mbarrier.arrive(k_empty.index((t - 1) % STAGES))
                n_other += 1
            if ME == 1:
                thread_barrier()
                mbarrier.arrive(q_free)
            # ---- epilogue: this half of the output (both warpgroups hold the final row max and
            # sum), the lse from warpgroup 0.
            has_keys = l_i != 0                 # NaN counts as keys: a NaN score reaches out and lse
            l_safe = gl.where(has_keys, l_i, 1.0)
            rows_o = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROWS_O)
            cols = ME * (D_NOPE // 2) + gl.arange(0, D_NOPE // 2, layout=gl.SliceLayout(0, O_LAYOUT))
            _ws_store_half(acc / gl.convert_layout(l_safe, ROWS_O)[:, None], rows_o, cols, req, part_idx, n_part,
                           rows_total, h_q, out_ptr, oacc_ptr, stride_ob, stride_os, stride_oh)
            if ME == 0:
                _ws_store_lse(gl.where(has_keys, m_i + gl.log2(l_safe), float("-inf")), rows_s, req, part_idx,
                              n_part, rows_total, h_q, lse_ptr, lseacc_ptr, stride_lb, stride_lh)
            n_split += 1


@gluon.jit
def _ws_shared(NOPE_DT: gl.constexpr, ROPE_DT: gl.constexpr, NOPE_LAYOUT: gl.constexpr, ROPE_LAYOUT: gl.constexpr,
               P_LAYOUT: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The shared memory of the split kernels built on ``_ws_softmax`` / ``_ws_pv`` (this one and
    the FP8 64-row tiles'), allocated and its mbarriers initialised: Q as ``[64, 512]`` in
    ``NOPE_DT`` and ``[64, 64]`` in ``ROPE_DT``; a ring of ``STAGES`` K tiles in the same two
    parts; one P tile ``[64, BLOCK_N]`` in ``NOPE_DT``; the rows' alpha and l (fp32); k_ready[s]
    (count 1: the tile landed), k_empty[s] (count 2: both MMA warpgroups done with it) and ``sync``:
    p_ready, p_empty, l_ready, l_free, o_stored (count 1 each)."""
    VEC: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    q_nope = gl.allocate_shared_memory(NOPE_DT, [BLOCK_H, D_NOPE], NOPE_LAYOUT)
    q_rope = gl.allocate_shared_memory(ROPE_DT, [BLOCK_H, D_ROPE], ROPE_LAYOUT)
    kn_ring = gl.allocate_shared_memory(NOPE_DT, [STAGES, BLOCK_N, D_NOPE], NOPE_LAYOUT)
    kr_ring = gl.allocate_shared_memory(ROPE_DT, [STAGES, BLOCK_N, D_ROPE], ROPE_LAYOUT)
    p_buf = gl.allocate_shared_memory(NOPE_DT, [BLOCK_H, BLOCK_N], P_LAYOUT)
    alpha_buf = gl.allocate_shared_memory(gl.float32, [BLOCK_H], VEC)
    l_buf = gl.allocate_shared_memory(gl.float32, [BLOCK_H], VEC)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    sync = gl.allocate_shared_memory(gl.int64, [5, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
    for i in gl.static_range(5):
        mbarrier.init(sync.index(i), count=1)
    fence_async_shared()
    return q_nope, q_rope, kn_ring, kr_ring, p_buf, alpha_buf, l_buf, k_ready, k_empty, sync


@gluon.jit
def mla_split_ws_kernel(
    q_ptr, kn_desc, kr_desc, bt_ptr, seqlens_ptr, meta_ptr, splits_ptr,
    out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, cnt_ptr,
    batch, h_q, s_q, rows_total, num_slots, num_blocks, max_tokens, qk_scale,
    stride_qb, stride_qs, stride_qh, stride_btb,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, KV_PAGE: gl.constexpr,
    FUSED_SPLITS: gl.constexpr, MERGE_ROWS: gl.constexpr, Q_AHEAD: gl.constexpr, PDL: gl.constexpr,
    num_warps: gl.constexpr, SEESAW: gl.constexpr = 0,
):
    """Attention of 64 query rows over the splits of one part of the schedule, on a producer warp
    and two consumer warpgroups (``num_warps = 4``: the default partition is the softmax
    warpgroup; the PV warpgroup and the producer are worker partitions).

    Grid: (head tiles, metadata rows - 1); program p runs slots ``meta[p, 7] .. meta[p + 1, 7] - 1``
    (clamped to the metadata): one slot of the slots schedule, or a part's run. kn_desc /
    kr_desc: TMA descriptors over the cache as ``[num_blocks * KV_PAGE, 576]`` rows, boxes of
    ``min(KV_PAGE, BLOCK_N)`` rows: ``[., 512]`` (columns 0..511) and ``[., 64]`` (columns
    512..575). Scores in the log2 domain (``qk_scale = softmax_scale * log2(e)``).

    Switches (``configs.CONFIGS["wgmma"]``): ``FUSED_SPLITS`` > 0: requests of 2..FUSED_SPLITS
    splits are merged by the last of their splits to finish, each output half by its warpgroup
    (arrival counters in ``cnt_ptr``: zeroed scratch of ``[batch, 8 head tiles, 2 halves]``
    int32, left zero; a second copy of the partial lse at ``lseacc_ptr + num_slots *
    rows_total``), the rest by the combine kernel; ``MERGE_ROWS``: the head tile's rows that can
    be valid (16, 32, 64). ``Q_AHEAD``: the next split's Q is issued under the current split's last
    tile. ``SEESAW`` = 1: the two MMA warpgroups alternate tiles (``_seesaw_wg``; neither lever
    above with it, nor PDL 2). ``PDL`` >= 1: the next kernel (the combine, a programmatic dependent launch) may launch
    once every program has started; 2: this kernel is one too, and every partition waits for the
    previous kernels' end before it touches memory."""
    dtype: gl.constexpr = kn_desc.dtype

    if PDL >= 2:      # launched as a dependent: nothing of the previous kernels is read before their end
        _gdc_wait()
    if PDL >= 1:      # the combine (a dependent launch) may start its programs as these end
        _gdc_launch_dependents()
    # The head tile is the grid's fastest axis: the tiles of one run start together on
    # neighbouring SMs and stream the same KV pages, so the second reads them from L2.
    pid_h, slot_first, slot_last = _program_run(meta_ptr, num_slots)
    if slot_first == slot_last:
        return
    KN_SMEM: gl.constexpr = kn_desc.layout
    KR_SMEM: gl.constexpr = kr_desc.layout
    P_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(128, BLOCK_N * 2), element_bitwidth=16, rank=2)
    q_nope, q_rope, kn_ring, kr_ring, p_buf, alpha_buf, l_buf, k_ready, k_empty, sync = _ws_shared(
        dtype, dtype, KN_SMEM, KR_SMEM, P_SMEM, BLOCK_N, STAGES)

    if SEESAW:
        gl.static_assert((FUSED_SPLITS == 0) & (not Q_AHEAD) & (PDL < 2),
                         "the seesaw form has no fused combine, Q ahead or dependent launch of its own")
        VEC: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        m_buf = gl.allocate_shared_memory(gl.float32, [BLOCK_H], VEC)
        # (sync: pub[0], pub[1], q_ready, q_free)
        gl.warp_specialize([
            (_seesaw_wg, (0, q_ptr, q_nope, q_rope, kn_ring, kr_ring, p_buf, m_buf, l_buf, alpha_buf, k_ready, k_empty,
                          sync.index(0), sync.index(1), sync.index(2), sync.index(3), meta_ptr, splits_ptr,
                          seqlens_ptr, batch, num_slots, max_tokens, slot_first, slot_last, pid_h, h_q, s_q, qk_scale,
                          rows_total, out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, stride_qb, stride_qs, stride_qh,
                          stride_ob, stride_os, stride_oh, stride_lb, stride_lh, CAUSAL, BLOCK_N, STAGES)),
            (_seesaw_wg, (1, q_ptr, q_nope, q_rope, kn_ring, kr_ring, p_buf, m_buf, l_buf, alpha_buf, k_ready, k_empty,
                          sync.index(1), sync.index(0), sync.index(2), sync.index(3), meta_ptr, splits_ptr,
                          seqlens_ptr, batch, num_slots, max_tokens, slot_first, slot_last, pid_h, h_q, s_q, qk_scale,
                          rows_total, out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, stride_qb, stride_qs, stride_qh,
                          stride_ob, stride_os, stride_oh, stride_lb, stride_lh, CAUSAL, BLOCK_N, STAGES)),
            (_ws_producer, (kn_desc, kr_desc, kn_ring, kr_ring, k_ready, k_empty, bt_ptr, stride_btb, meta_ptr,
                            splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, num_blocks, slot_first, slot_last,
                            BLOCK_N, STAGES, KV_PAGE, PDL)),
        ], [4, 1], [240, 24])      # (sm_90a, Triton 3.6: 692 bytes of scalar spills)
        return
    # (argument tuples written out in the call: a tuple held in a variable loses its constexprs)
    gl.warp_specialize([
        (_ws_softmax, (q_ptr, q_nope, q_rope, kn_ring, kr_ring, p_buf, alpha_buf, l_buf, k_ready, k_empty,
                       sync.index(0), sync.index(1), sync.index(2), sync.index(3), sync.index(4), meta_ptr, splits_ptr,
                       seqlens_ptr, batch, num_slots, max_tokens, slot_first, slot_last, pid_h, h_q, s_q, qk_scale,
                       rows_total, out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, stride_qb, stride_qs, stride_qh, stride_ob,
                       stride_os, stride_oh, stride_lb, stride_lh, CAUSAL, BLOCK_N, STAGES, FUSED_SPLITS, Q_AHEAD)),
        (_ws_pv, (kn_ring, p_buf, alpha_buf, l_buf, k_ready, k_empty, sync.index(0), sync.index(1),
                  sync.index(2), sync.index(3), sync.index(4), meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens,
                  slot_first, slot_last, pid_h, h_q, rows_total, out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, cnt_ptr,
                  stride_ob, stride_os, stride_oh, stride_lb, stride_lh, BLOCK_N, STAGES, FUSED_SPLITS, MERGE_ROWS,
                  PDL)),
        (_ws_producer, (kn_desc, kr_desc, kn_ring, kr_ring, k_ready, k_empty, bt_ptr, stride_btb, meta_ptr,
                        splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, num_blocks, slot_first, slot_last,
                        BLOCK_N, STAGES, KV_PAGE, PDL)),
    ], [4, 1], [232, 40])
