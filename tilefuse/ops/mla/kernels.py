"""Triton kernels for MLA decode attention over a paged latent cache.

Two launches per decode step, both sized from static shapes so the step can be captured in a
CUDA graph and replayed with new lengths:

1. ``mla_metadata_kernel`` (one program): schedule the KV pages of the whole batch (even splits
   handed to SMs as they free, or ``num_parts`` parts of equal work, whichever the cost model
   prefers) and write the splits, one per *slot* (request, split, page range), and each Gluon
   program's run of slots (``get_mla_metadata``).
2. ``mla_split_standard_kernel`` / ``mla_split_transposed_kernel`` (SLOT_PROGRAMS programs per
   slot, one per head tile): attention of the query rows of one request over (a part of) one
   split of its pages. A request with one program writes its final output; otherwise each
   program writes a partial (normalised output, log-sum-exp) and the last one of the request to
   finish merges them (``_finish``, arrival counters in zeroed scratch), or ``mla_combine_kernel``
   does in a second launch.

The metadata only schedules: every kernel takes a request's length from ``cache_seqlens``, its
split count and first partial from ``num_splits``, and recomputes its page range from those, so
metadata planned for other lengths costs balance, never correctness. Every index read from
memory is checked or clamped before use (requests, splits, partial slots, cache pages), so no
contents of the metadata, ``num_splits`` or the block table can move an access outside its tensor.

Query rows: the ``s_q * h_q`` (token, head) pairs of one request, row ``r = t * h_q + h``.
Scores are kept in the log2 domain (``qk_scale = softmax_scale * log2(e)``), so the softmax uses
``exp2``; the returned lse is converted back to the natural log.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from tilefuse.ops.mla.reference import HEAD_DIM, HEAD_DIM_V, PAGE_SIZE
from tilefuse.ops.tl_common import arrive

PAGE = tl.constexpr(PAGE_SIZE)            # tokens per scheduling chunk (FlashMLA's page); the cache's
                                          # own page size is each split kernel's KV_PAGE
D_NOPE = tl.constexpr(HEAD_DIM_V)         # latent part of the 576-wide vector: the K "nope" part and all of V
D_ROPE = tl.constexpr(HEAD_DIM - HEAD_DIM_V)   # RoPE part, only in K
LN2 = tl.constexpr(0.6931471805599453)
LOG2E_K = tl.constexpr(1.4426950408889634)
FP8_GROUP = tl.constexpr(128)             # the FP8 layout's values per fp32 scale
FP8_GROUPS = tl.constexpr(HEAD_DIM_V // 128)


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _splits(pages, in_batch, chunk):
    """Splits of each request when cut in chunks of at most ``chunk`` pages (one for an empty
    request; 0 past the batch)."""
    return tl.where(in_batch, tl.maximum((pages + chunk - 1) // chunk, 1), 0)


@triton.jit
def _schedule_cost2(total, slots, chunk, num_parts, SPLIT_COST: tl.constexpr):
    """Twice the expected busiest part, in pages, of ``slots`` splits of at most ``chunk`` pages
    over ``num_parts`` parts, each split costing SPLIT_COST pages more (``configs.schedule_cost``
    says why)."""
    longest = chunk + SPLIT_COST
    spread = (2 * (total + SPLIT_COST * slots) + num_parts - 1) // num_parts + longest
    return tl.where(slots <= num_parts, 2 * longest, tl.maximum(2 * longest, spread))


@triton.jit
def _cut(p, total, parts):
    """Where part ``p`` of ``parts`` begins on the batch's work line of ``total`` units:
    floor(p total / parts), in 64-bit (p total overflows int32 on long batches)."""
    return ((p.to(tl.int64) * total) // parts).to(tl.int32)


@triton.jit
def _cdiv_parts(x, parts, total):
    """ceil(x parts / total) in 64-bit: the first part whose cut lies at or past ``x``."""
    return ((x.to(tl.int64) * parts + total - 1) // total).to(tl.int32)


@triton.jit
def mla_metadata_kernel(
    seqlens_ptr, meta_ptr, num_splits_ptr,      # [b] int32 in; [num_slots, 8] and [b + 1] int32 out
    starts_ptr,                                 # [b] int32 scratch: each request's first page on the parts line
    batch, num_parts, num_slots,                # sizes: num_parts = SMs (or SM groups) to fill
    BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr, SPLIT_COST: tl.constexpr, CANDIDATES: tl.constexpr,
    PART_COST: tl.constexpr, PART_MIN2: tl.constexpr, PART_GAIN_PCT: tl.constexpr,
):
    # The whole batch's lengths fit in one program's registers (BLOCK_B = next_pow2(b)).
    offs_b = tl.arange(0, BLOCK_B)
    in_batch = offs_b < batch
    lens = tl.maximum(tl.load(seqlens_ptr + offs_b, mask=in_batch, other=0), 0)
    pages = (lens + PAGE - 1) // PAGE
    # ---- Schedule 1, slots: even splits of at most `chunk` pages, one program each, handed to SMs
    # as they free. The smallest chunk with at most num_parts splits (one wave) by bisection between
    # ceil(total / num_parts) (a lower bound) and ceil(total / (num_parts - b)) (always fits), then
    # smaller chunks (several waves: 1.5x, 1x, 3/4, 1/2, ... of the balanced share) where the
    # expected busiest part is shorter and the splits fit below the last metadata row.
    total = tl.sum(pages, axis=0)
    room = tl.maximum(num_parts - batch, 1)
    upper = tl.maximum((total + room - 1) // room, 1)
    lower = tl.minimum(tl.maximum((total + num_parts - 1) // num_parts, 1), upper)
    balanced = lower
    while lower < upper:
        mid = (lower + upper) // 2
        fits = tl.sum(_splits(pages, in_batch, mid), axis=0) <= num_parts
        upper = tl.where(fits, mid, upper)
        lower = tl.where(fits, lower, mid + 1)
    chunk = upper
    best = _schedule_cost2(total, tl.sum(_splits(pages, in_batch, chunk), axis=0), chunk, num_parts, SPLIT_COST)
    for c in range(CANDIDATES):
        cand = tl.maximum((balanced * (3 - c % 2)) >> (c // 2 + 1), 1)
        slots = tl.sum(_splits(pages, in_batch, cand), axis=0)
        cost = _schedule_cost2(total, slots, cand, num_parts, SPLIT_COST)
        better = (cost < best) & (slots < num_slots)
        chunk = tl.where(better, cand, chunk)
        best = tl.where(better, cost, best)
    # ---- Schedule 2, parts: request i takes PART_COST units then one per page on a line ([W_i,
    # a_i) then pages [a_i, e_i)); the line's `line` units are cut into `parts` equal parts, part p
    # from cut(p) = floor(p line / parts) (at most `line` parts: the cuts strictly increase); a cut
    # inside a request's pages splits it there: request i's cuts are parts [lo_i, hi_i).
    # ---- The pick (configs.PART_GAIN): parts where their busiest part (share + a split cost)
    # is well below the slots' expected busiest, on batches long enough for it to pay. It needs
    # only the line's length; the requests' starts on the line are stored (and read per slot)
    # only when parts are picked (under the slots the prefix sum runs on zeros).
    line = tl.maximum(total + PART_COST * batch, 1)
    parts = tl.minimum(num_parts, line)
    parts_cost2 = 2 * ((line + parts - 1) // parts + PART_COST)
    use_parts = (best >= PART_MIN2) & (parts_cost2.to(tl.int64) * 100 <= best.to(tl.int64) * PART_GAIN_PCT)
    # (the scalar pick as a boolean vector in masks: Triton 3.9's interpreter turns `tensor &
    # scalar bool` into integers)
    parts_b = (offs_b * 0 + use_parts.to(tl.int32)) != 0
    e = tl.cumsum(tl.where(parts_b & in_batch, pages + PART_COST, 0), axis=0)
    a = e - pages
    lo = _cdiv_parts(a + 1, parts, line)
    hi = _cdiv_parts(e, parts, line)
    splits = tl.where(use_parts, tl.where(in_batch, 1 + tl.maximum(hi - lo, 0), 0), _splits(pages, in_batch, chunk))
    cu_end = tl.cumsum(splits, axis=0)          # slots of requests 0..i
    cu_begin = cu_end - splits
    used = tl.sum(splits, axis=0)
    tl.store(num_splits_ptr + offs_b, cu_begin, mask=in_batch)
    tl.store(num_splits_ptr + batch, used)
    tl.store(starts_ptr + offs_b, a, mask=in_batch & parts_b)
    # ---- Columns 0 and 7 to -1 (the running maxima below start from it).
    for p0 in range(0, num_slots, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        in_range = offs_p < num_slots
        tl.store(meta_ptr + offs_p * 8, -1, mask=in_range)
        tl.store(meta_ptr + offs_p * 8 + 7, -1, mask=in_range)
    tl.debug_barrier()
    # ---- Each request's first slot gets its index i, nondecreasing in i, so a running maximum
    # over the slots carries it to the request's other slots. Parts schedule: row p's column 7 =
    # part p's first slot; the parts that begin in request i's fixed cost (cut(p) in [W_i, a_i],
    # p in [r_i, min(lo_i, hi_i))) begin at its first split: row r_i gets it, the others inherit it
    # below.
    tl.store(meta_ptr + cu_begin * 8, offs_b, mask=in_batch)
    r = _cdiv_parts(a - PART_COST, parts, line)
    tl.store(meta_ptr + r * 8 + 7, cu_begin, mask=in_batch & parts_b & (r < tl.minimum(lo, hi)))
    tl.debug_barrier()
    # ---- Per slot: request (running maximum), its first slot and split count from num_splits,
    # its pages from cache_seqlens (read as above), split k of n, its pages [begin, end): slots, k
    # per..(k + 1) per with per = ceil(pages / n); parts, [cut(lo + k - 1), cut(lo + k)) - a
    # (split 0 from page 0, the last to the request's end; a from the scratch row, lo from a),
    # split k >= 1 starting part lo + k - 1 (column 7).
    req_c = -1                                  # the running maximum of the rows before this block
    for p0 in range(0, num_slots, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        row = meta_ptr + offs_p * 8
        in_range = offs_p < num_slots
        req = tl.maximum(tl.associative_scan(tl.load(row, mask=in_range, other=-1), 0, _max), req_c)
        req_c = tl.max(req, 0)
        valid = offs_p < used
        req_ok = tl.minimum(tl.maximum(req, 0), tl.maximum(batch - 1, 0))
        first = tl.load(num_splits_ptr + req_ok, mask=in_range, other=0)
        n = tl.maximum(tl.load(num_splits_ptr + req_ok + 1, mask=in_range, other=1) - first, 1)
        pages_s = (tl.maximum(tl.load(seqlens_ptr + req_ok, mask=in_range, other=0), 0) + PAGE - 1) // PAGE
        k = offs_p - first
        parts_p = (offs_p * 0 + use_parts.to(tl.int32)) != 0
        a_s = tl.load(starts_ptr + req_ok, mask=in_range & parts_p, other=0)
        lo_s = _cdiv_parts(a_s + 1, parts, line)
        per = (pages_s + n - 1) // n
        begin = tl.where(use_parts, tl.where(k == 0, 0, _cut(lo_s + k - 1, line, parts) - a_s),
                         tl.minimum(k * per, pages_s))
        end = tl.where(use_parts, tl.where(k == n - 1, pages_s, _cut(lo_s + k, line, parts) - a_s),
                       tl.minimum(k * per + per, pages_s))
        tl.store(row + 0, tl.where(valid, req, -1), mask=in_range)
        tl.store(row + 1, tl.where(valid, k, 0), mask=in_range)
        tl.store(row + 2, tl.where(valid, begin, 0), mask=in_range)
        tl.store(row + 3, tl.where(valid, end, 0), mask=in_range)
        for c in range(4, 7):
            tl.store(row + c, 0, mask=in_range)
        # ---- Column 7, each program's first slot (program p runs slots meta[p, 7] .. meta[p + 1,
        # 7] - 1): slots, one slot each (p, or `used` past the last), final here; parts, split k
        # >= 1 marks the part it starts (the pass below carries the marks)
        tl.store(row + 7, tl.minimum(offs_p, used), mask=in_range & ~parts_p)
        tl.store(meta_ptr + (lo_s + k - 1) * 8 + 7, offs_p, mask=valid & (k > 0) & parts_p)
    if use_parts:
        # ---- Parts: a running maximum over parts 0..parts - 1 (each part begins a split or
        # inherits the first slot of the request it began in), `used` from part `parts` on.
        tl.debug_barrier()
        before = -1
        for p0 in range(0, num_slots, BLOCK_P):
            offs_p = p0 + tl.arange(0, BLOCK_P)
            row7 = meta_ptr + offs_p * 8 + 7
            in_range = offs_p < num_slots
            start = tl.maximum(tl.associative_scan(tl.load(row7, mask=in_range & (offs_p < parts), other=-1), 0,
                                                   _max), before)
            before = tl.max(start, 0)
            tl.store(row7, tl.where(offs_p < parts, start, used), mask=in_range)


@triton.jit
def _slot_work(meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, pid,
               SLOT_PROGRAMS: tl.constexpr):
    """What program ``pid`` computes: part ``pid % SLOT_PROGRAMS`` of the split that slot
    ``pid // SLOT_PROGRAMS`` runs.

    Returns (valid, request, first token, end token, length, partials of the request, its first
    partial, this program's partial). The length comes from ``cache_seqlens`` (clamped to the
    block table), the split count ``n`` and first slot from ``num_splits``; split ``s`` covers the
    pages the metadata planned for it (``row[2] .. row[3]``) clamped to the request's pages, split 0
    from page 0 and split ``n - 1`` to the last page, so a request's splits cover its pages exactly
    once whatever lengths the metadata was planned for. A slot whose request or split is out of
    range is not valid (the program does nothing). Partials are indexed by (request's first
    slot + split) * SLOT_PROGRAMS + part, so a request's partials are contiguous.
    """
    row = meta_ptr + (pid // SLOT_PROGRAMS) * 8
    req = tl.load(row)
    split = tl.load(row + 1)
    valid = (req >= 0) & (req < batch)
    req = tl.where(valid, req, 0)
    first = tl.load(splits_ptr + req)
    nxt = tl.load(splits_ptr + req + 1)
    # slots [first, nxt) of the request inside [0, num_slots], compared before any arithmetic
    # (so that no contents can overflow into an in-range index)
    valid = valid & (first >= 0) & (first < nxt) & (nxt <= num_slots)
    n = tl.where(valid, nxt - first, 1)
    valid = valid & (split >= 0) & (split < n)
    length = tl.minimum(tl.maximum(tl.load(seqlens_ptr + req), 0), max_tokens)
    pages = (length + PAGE - 1) // PAGE
    begin = tl.where(split == 0, 0, tl.minimum(tl.maximum(tl.load(row + 2), 0), pages))
    end = tl.where(split == n - 1, pages, tl.minimum(tl.maximum(tl.load(row + 3), begin), pages))
    part = pid % SLOT_PROGRAMS
    per_part = (end - begin + SLOT_PROGRAMS - 1) // SLOT_PROGRAMS
    part_begin = tl.minimum(begin + part * per_part, end)
    tok_end = tl.minimum(tl.minimum(part_begin + per_part, end) * PAGE, length)
    return (valid, req, part_begin * PAGE, tok_end, length, n * SLOT_PROGRAMS, first * SLOT_PROGRAMS,
            (first + split) * SLOT_PROGRAMS + part)


@triton.jit
def _store_final(o, lse2, rows, row_ok, offs_v, req, h_q, out_ptr, lse_ptr,
                 stride_ob, stride_os, stride_oh, stride_lb, stride_lh):
    """out[req, t, h, :] = o (q's dtype); lse[req, h, t] in natural log, +inf for a row with no key."""
    tok = rows // h_q
    head = rows % h_q
    o_ptrs = out_ptr + req * stride_ob + tok[:, None] * stride_os + head[:, None] * stride_oh + offs_v[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    lse = tl.where(lse2 == float("-inf"), float("inf"), lse2 * LN2)
    tl.store(lse_ptr + req * stride_lb + head * stride_lh + tok, lse, mask=row_ok)


@triton.jit
def _finish(acc, l_i, m_i, rows, row_ok, offs_v, req, pid_part, pid_h, n_part, first_part, h_q,
            out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, cnt_ptr, rows_total,
            stride_ob, stride_os, stride_oh, stride_lb, stride_lh, FUSED_COMBINE: tl.constexpr):
    """Normalise the [rows, 512] accumulator and write the result.

    A request with one program writes its output directly. Otherwise each program writes a
    partial (normalised output, log2-sum-exp) at index ``pid_part``. FUSED_COMBINE: the program
    bumps the request's arrival counter (zeroed scratch, one per (request, head tile)) and the
    one that arrives last merges all ``n_part`` partials (read back from L2) and re-arms the
    counter; else ``mla_combine_kernel`` merges them in a second launch.
    """
    has_keys = l_i != 0                     # NaN counts as keys: a NaN score propagates to out and lse
    l_safe = tl.where(has_keys, l_i, 1.0)
    lse2 = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
    if n_part == 1:
        _store_final(acc / l_safe[:, None], lse2, rows, row_ok, offs_v, req, h_q, out_ptr, lse_ptr,
                     stride_ob, stride_os, stride_oh, stride_lb, stride_lh)
    else:
        part = pid_part * rows_total + rows
        tl.store(oacc_ptr + part[:, None] * D_NOPE + offs_v[None, :], acc / l_safe[:, None], mask=row_ok[:, None])
        tl.store(lseacc_ptr + part, lse2, mask=row_ok)
    if FUSED_COMBINE:
        if n_part > 1:
            counter = cnt_ptr + req * 8 + pid_h
            if arrive(counter, 1, n_part):
                # Every partial of the request has arrived: re-arm the counter for the next call.
                tl.atomic_xchg(counter, 0, sem="relaxed")
                m = tl.full(lse2.shape, float("-inf"), tl.float32)
                for s in range(0, n_part):
                    part = (first_part + s) * rows_total + rows
                    lse_s = tl.load(lseacc_ptr + part, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
                    m = tl.maximum(m, lse_s)
                m_safe = tl.where(m == float("-inf"), 0.0, m)
                total = tl.zeros(lse2.shape, tl.float32)
                o = tl.zeros(acc.shape, tl.float32)
                for s in range(0, n_part):
                    part = (first_part + s) * rows_total + rows
                    lse_s = tl.load(lseacc_ptr + part, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
                    w = tl.exp2(lse_s - m_safe)
                    total += w
                    o += w[:, None] * tl.load(oacc_ptr + part[:, None] * D_NOPE + offs_v[None, :], mask=row_ok[:, None],
                                              other=0.0, cache_modifier=".cg")
                has_keys = total != 0
                t_safe = tl.where(has_keys, total, 1.0)
                _store_final(o / t_safe[:, None], tl.where(has_keys, m_safe + tl.log2(t_safe), float("-inf")),
                             rows, row_ok, offs_v, req, h_q, out_ptr, lse_ptr,
                             stride_ob, stride_os, stride_oh, stride_lb, stride_lh)


@triton.jit
def _query_rows(q_ptr, req, pid_h, h_q, s_q, rows_total, length, stride_qb, stride_qs, stride_qh,
                CAUSAL: tl.constexpr, BLOCK_H: tl.constexpr):
    """This program's query rows: (rows, in range, their Q pointers, last key position each sees)."""
    rows = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    tok = rows // h_q
    # Causal: query token t of s_q sits at position L - s_q + t.
    limit = length - 1 - tl.where(CAUSAL, s_q - 1 - tok, 0)
    q_rows = q_ptr + req * stride_qb + tok * stride_qs + (rows % h_q) * stride_qh
    return rows, rows < rows_total, q_rows, limit


@triton.jit
def _page_of(bt_row, token, last_page, num_blocks, KV_PAGE: tl.constexpr):
    """Cache page holding ``token`` of the request, pages of KV_PAGE tokens (the block-table
    column clamped to the slot's last page; the entry clamped to the cache, so a bad table cannot
    read outside it). ``token`` may be a scalar or a vector."""
    page = tl.load(bt_row + tl.minimum(token // KV_PAGE, last_page))
    return tl.minimum(tl.maximum(page, 0), num_blocks - 1).to(tl.int64)


FP16_MAX = tl.constexpr(65504.0)


@triton.jit
def _rope_shift(rope):
    """A power of two that brings the fp32 values ``rope`` within fp16's range (2^15 at most
    after division): 1 unless some |value| exceeds 65504 (bf16 RoPE values can)."""
    r_max = tl.max(tl.max(tl.abs(rope), axis=1), axis=0)
    return tl.where(r_max > FP16_MAX, tl.exp2(tl.ceil(tl.log2(tl.maximum(r_max, 1.0))) - 15.0), 1.0)


@triton.jit
def _kv_rows(k_rows, ok, KV_FP8: tl.constexpr, DTYPE: tl.constexpr, KV_SHIFT: tl.constexpr = False):
    """The cached tokens at ``k_rows`` (one row pointer each): HBM -> registers, in ``DTYPE``.
    Rows where ``ok`` is false load as 0 (their slots may hold NaN and are never read). Returns
    the 512-wide part (K "nope" and all of V), the 64-wide RoPE part and the two parts' shifts
    (fp32 scalars, 1 but with ``KV_SHIFT``): the values are the cache's divided by them.

    ``KV_FP8``: the rows are FlashMLA's 656-byte FP8 layout (``k_rows`` as bytes): 512 e4m3
    values, 4 fp32 scales (one per 128 values), 64 bf16 RoPE values; the 512 are dequantized in
    fp32 (value x its group's scale) and rounded once to ``DTYPE``, as ``mla_dequantize_kv`` does.
    ``KV_SHIFT`` (an FP8 cache read as fp16, whose range ends at 65504 where e4m3 x scale and
    bf16 do not): a tile whose largest scale could take a value past 65504 is dequantized
    divided by that scale (codes x scale / max scale <= 448), and RoPE values past 65504 are
    divided by a power of two (:func:`_rope_shift`); the caller multiplies its fp32 products by
    the shifts. Tiles of ordinary magnitudes keep shifts of 1 (the values unchanged)."""
    k_shift = tl.full([], 1.0, tl.float32)
    r_shift = tl.full([], 1.0, tl.float32)
    if KV_FP8:
        codes = tl.load(k_rows[:, None] + tl.arange(0, D_NOPE)[None, :], mask=ok[:, None], other=0)
        scale_rows = (k_rows + D_NOPE).to(tl.pointer_type(tl.float32))
        scales = tl.load(scale_rows[:, None] + tl.arange(0, FP8_GROUPS)[None, :], mask=ok[:, None], other=0.0)
        values = tl.reshape(codes.to(tl.float8e4nv, bitcast=True).to(tl.float32),
                            [k_rows.shape[0], FP8_GROUPS, FP8_GROUP])
        if KV_SHIFT:
            # ---- fp16: the tile's largest scale out of the values where 448 x it would pass 65504
            s_max = tl.max(tl.max(scales, axis=1), axis=0)
            k_shift = tl.where(s_max * 448.0 > FP16_MAX, s_max, 1.0)
            scales = scales / k_shift
        k_nope = tl.reshape(values * scales[:, :, None], [k_rows.shape[0], D_NOPE]).to(DTYPE)
        rope_rows = (k_rows + D_NOPE + 4 * FP8_GROUPS).to(tl.pointer_type(tl.bfloat16))
        k_rope = tl.load(rope_rows[:, None] + tl.arange(0, D_ROPE)[None, :], mask=ok[:, None], other=0.0)
        if KV_SHIFT:    # ---- fp16: RoPE values past 65504 divided by a power of two
            k_rope = k_rope.to(tl.float32)
            r_shift = _rope_shift(k_rope)
            k_rope = k_rope / r_shift
        k_rope = k_rope.to(DTYPE)
    else:
        k_nope = tl.load(k_rows[:, None] + tl.arange(0, D_NOPE)[None, :], mask=ok[:, None], other=0.0)
        k_rope = tl.load(k_rows[:, None] + D_NOPE + tl.arange(0, D_ROPE)[None, :], mask=ok[:, None], other=0.0)
    return k_nope, k_rope, k_shift, r_shift


@triton.jit
def _kv_tile(kc_ptr, page, start, length, stride_kp, stride_kt, bt_row, last_page, num_blocks,
             BLOCK_N: tl.constexpr, KV_PAGE: tl.constexpr, KV_FP8: tl.constexpr, DTYPE: tl.constexpr,
             KV_SHIFT: tl.constexpr):
    """Tokens ``start .. start + BLOCK_N``: HBM -> SMEM (pipelined by num_stages) -> ``DTYPE``
    (:func:`_kv_rows`). With pages of at least BLOCK_N tokens the tile lies in one page, ``page``
    (looked up a step ahead by the caller); with smaller pages (16, 32) each token's page is
    looked up here. Returns positions, the 512-wide and the RoPE parts and their shifts
    (:func:`_kv_rows`); positions past ``length`` load as 0."""
    pos = start + tl.arange(0, BLOCK_N)
    if KV_PAGE >= BLOCK_N:
        k_rows = kc_ptr + page * stride_kp + (pos % KV_PAGE) * stride_kt
    else:
        k_rows = kc_ptr + _page_of(bt_row, pos, last_page, num_blocks, KV_PAGE) * stride_kp \
            + (pos % KV_PAGE) * stride_kt
    k_nope, k_rope, k_shift, r_shift = _kv_rows(k_rows, pos < length, KV_FP8, DTYPE, KV_SHIFT)
    return pos, k_nope, k_rope, k_shift, r_shift


@triton.jit
def _attend_tile(q_nope, q_rope, k_nope, k_rope, k_shift, r_shift, keep, qk_scale, m_i, l_i, acc,
                 DOT_PREC: tl.constexpr, KV_SHIFT: tl.constexpr):
    """One KV tile in the standard orientation: S = Q K^T ([BLOCK_H, BLOCK_N], the 512-wide and
    RoPE parts), scores outside ``keep`` at -inf, then the online softmax step (rows with no key
    yet keep m = -inf, p = 0) and O = O alpha + P V. ``KV_SHIFT``: K and V came divided by
    ``k_shift`` / ``r_shift`` (:func:`_kv_rows`), multiplied back into the fp32 products.
    Returns the new (m, l, O)."""
    if KV_SHIFT:
        s = tl.dot(q_nope, tl.trans(k_nope), input_precision=DOT_PREC) * k_shift
        s += tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PREC) * r_shift
    else:
        s = tl.dot(q_nope, tl.trans(k_nope), input_precision=DOT_PREC)
        s = tl.dot(q_rope, tl.trans(k_rope), s, input_precision=DOT_PREC)
    s = tl.where(keep, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if KV_SHIFT:
        acc = acc * alpha[:, None] + tl.dot(p.to(k_nope.dtype), k_nope, input_precision=DOT_PREC) * k_shift
    else:
        acc = tl.dot(p.to(k_nope.dtype), k_nope, acc * alpha[:, None], input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _attend_tile_t(qt_nope, qt_rope, k_nope, k_rope, k_shift, r_shift, keep_t, qk_scale, m_i, l_i, acc_t,
                   DOT_PREC: tl.constexpr, KV_SHIFT: tl.constexpr):
    """:func:`_attend_tile` transposed (ETAP): S^T = K Q^T ([BLOCK_N, BLOCK_H], the KV tile as the
    MMA's M dimension), the online softmax down the KV axis (axis 0), O^T = O^T alpha + V^T P^T
    ([512, BLOCK_H]); ``KV_SHIFT`` as there. Returns the new (m, l, O^T)."""
    if KV_SHIFT:
        s_t = tl.dot(k_nope, qt_nope, input_precision=DOT_PREC) * k_shift
        s_t += tl.dot(k_rope, qt_rope, input_precision=DOT_PREC) * r_shift
    else:
        s_t = tl.dot(k_nope, qt_nope, input_precision=DOT_PREC)
        s_t = tl.dot(k_rope, qt_rope, s_t, input_precision=DOT_PREC)
    s_t = tl.where(keep_t, s_t * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s_t, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p_t = tl.exp2(s_t - m_safe[None, :])
    l_i = l_i * alpha + tl.sum(p_t, axis=0)
    if KV_SHIFT:
        acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(k_nope), p_t.to(k_nope.dtype),
                                                input_precision=DOT_PREC) * k_shift
    else:
        acc_t = tl.dot(tl.trans(k_nope), p_t.to(k_nope.dtype), acc_t * alpha[None, :], input_precision=DOT_PREC)
    return m_new, l_i, acc_t


@triton.jit
def mla_split_standard_kernel(
    q_ptr, kc_ptr, bt_ptr, seqlens_ptr, meta_ptr, splits_ptr,
    out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, cnt_ptr,
    batch, h_q, s_q, rows_total, num_slots, num_blocks, max_tokens, qk_scale,
    stride_qb, stride_qs, stride_qh, stride_kp, stride_kt, stride_btb,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    CAUSAL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    FUSED_COMBINE: tl.constexpr, SLOT_PROGRAMS: tl.constexpr, KV_PAGE: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Heads as the MMA's M dimension: S = Q K^T ([BLOCK_H, BLOCK_N]), O = P V ([BLOCK_H, 512]).

    BLOCK_H = 64 query rows per program so Hopper's WGMMA (M = 64) applies; the [64, 512] fp32
    accumulator is 128 registers per thread at num_warps = 8.
    """
    # an FP8 cache read as fp16 (q's dtype): values kept within fp16's range (_kv_rows)
    KV_SHIFT: tl.constexpr = KV_FP8 and q_ptr.dtype.element_ty == tl.float16
    pid_part = tl.program_id(0)                 # a part of a slot (SLOT_PROGRAMS parts per slot)
    pid_h = tl.program_id(1)
    valid, req, tok_begin, tok_end, length, n_part, first_part, part_idx = _slot_work(
        meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, pid_part, SLOT_PROGRAMS)
    if not valid:
        return
    rows, row_ok, q_rows, limit = _query_rows(q_ptr, req, pid_h, h_q, s_q, rows_total, length,
                                              stride_qb, stride_qs, stride_qh, CAUSAL, BLOCK_H)
    offs_v = tl.arange(0, D_NOPE)
    offs_r = tl.arange(0, D_ROPE)
    # Q: HBM -> registers once, [BLOCK_H, 512] + [BLOCK_H, 64]; padded rows load as 0.
    q_nope = tl.load(q_rows[:, None] + offs_v[None, :], mask=row_ok[:, None], other=0.0)
    q_rope = tl.load(q_rows[:, None] + D_NOPE + offs_r[None, :], mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_NOPE], tl.float32)
    bt_row = bt_ptr + req * stride_btb
    last_page = tl.maximum(tok_end - 1, 0) // KV_PAGE
    page = _page_of(bt_row, tok_begin, last_page, num_blocks, KV_PAGE)
    for start in tl.range(tok_begin, tok_end, BLOCK_N):
        # Page of the next step loaded one step ahead (a loop-carried value, not a load the tile
        # load waits on), so the pipeliner can prefetch K tiles several steps deep.
        next_page = _page_of(bt_row, start + BLOCK_N, last_page, num_blocks, KV_PAGE)
        pos, k_nope, k_rope, k_shift, r_shift = _kv_tile(kc_ptr, page, start, length, stride_kp, stride_kt, bt_row,
                                                         last_page, num_blocks, BLOCK_N, KV_PAGE, KV_FP8,
                                                         q_nope.dtype, KV_SHIFT)
        m_i, l_i, acc = _attend_tile(q_nope, q_rope, k_nope, k_rope, k_shift, r_shift, pos[None, :] <= limit[:, None],
                                     qk_scale, m_i, l_i, acc, DOT_PREC, KV_SHIFT)
        page = next_page
    _finish(acc, l_i, m_i, rows, row_ok, offs_v, req, part_idx, pid_h, n_part, first_part, h_q,
            out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, cnt_ptr, rows_total,
            stride_ob, stride_os, stride_oh, stride_lb, stride_lh, FUSED_COMBINE)


@triton.jit
def mla_split_transposed_kernel(
    q_ptr, kc_ptr, bt_ptr, seqlens_ptr, meta_ptr, splits_ptr,
    out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, cnt_ptr,
    batch, h_q, s_q, rows_total, num_slots, num_blocks, max_tokens, qk_scale,
    stride_qb, stride_qs, stride_qh, stride_kp, stride_kt, stride_btb,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    CAUSAL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    FUSED_COMBINE: tl.constexpr, SLOT_PROGRAMS: tl.constexpr, KV_PAGE: tl.constexpr, KV_FP8: tl.constexpr,
):
    """ETAP: the KV length as the MMA's M dimension. S^T = K Q^T ([BLOCK_N, BLOCK_H]), softmax over
    axis 0, O^T = V^T P^T ([512, BLOCK_H]). For s_q * h_q < 64 nothing is padded to 64 rows: the
    dots have M = BLOCK_N (64) and M = 512, N = BLOCK_H (16 or 32).

    A deliberate twin of :func:`mla_split_standard_kernel`: the same prologue and page loop, every
    tile transposed; two kernels so that each reads as one orientation."""
    # an FP8 cache read as fp16 (q's dtype): values kept within fp16's range (_kv_rows)
    KV_SHIFT: tl.constexpr = KV_FP8 and q_ptr.dtype.element_ty == tl.float16
    pid_part = tl.program_id(0)                 # a part of a slot (SLOT_PROGRAMS parts per slot)
    pid_h = tl.program_id(1)
    valid, req, tok_begin, tok_end, length, n_part, first_part, part_idx = _slot_work(
        meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, pid_part, SLOT_PROGRAMS)
    if not valid:
        return
    rows, row_ok, q_rows, limit = _query_rows(q_ptr, req, pid_h, h_q, s_q, rows_total, length,
                                              stride_qb, stride_qs, stride_qh, CAUSAL, BLOCK_H)
    offs_v = tl.arange(0, D_NOPE)
    offs_r = tl.arange(0, D_ROPE)
    # Q^T: HBM -> registers once, [512, BLOCK_H] + [64, BLOCK_H].
    qt_nope = tl.load(q_rows[None, :] + offs_v[:, None], mask=row_ok[None, :], other=0.0)
    qt_rope = tl.load(q_rows[None, :] + D_NOPE + offs_r[:, None], mask=row_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_t = tl.zeros([D_NOPE, BLOCK_H], tl.float32)
    bt_row = bt_ptr + req * stride_btb
    last_page = tl.maximum(tok_end - 1, 0) // KV_PAGE
    page = _page_of(bt_row, tok_begin, last_page, num_blocks, KV_PAGE)
    for start in tl.range(tok_begin, tok_end, BLOCK_N):
        # Page of the next step loaded one step ahead (a loop-carried value, not a load the tile
        # load waits on), so the pipeliner can prefetch K tiles several steps deep.
        next_page = _page_of(bt_row, start + BLOCK_N, last_page, num_blocks, KV_PAGE)
        pos, k_nope, k_rope, k_shift, r_shift = _kv_tile(kc_ptr, page, start, length, stride_kp, stride_kt, bt_row,
                                                         last_page, num_blocks, BLOCK_N, KV_PAGE, KV_FP8,
                                                         qt_nope.dtype, KV_SHIFT)
        m_i, l_i, acc_t = _attend_tile_t(qt_nope, qt_rope, k_nope, k_rope, k_shift, r_shift,
                                         pos[:, None] <= limit[None, :], qk_scale, m_i, l_i, acc_t, DOT_PREC, KV_SHIFT)
        page = next_page
    _finish(tl.trans(acc_t), l_i, m_i, rows, row_ok, offs_v, req, part_idx, pid_h, n_part, first_part,
            h_q, out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, cnt_ptr, rows_total,
            stride_ob, stride_os, stride_oh, stride_lb, stride_lh, FUSED_COMBINE)


@triton.jit
def _merge_partials(oacc_ptr, lseacc_ptr, first, n, rows_total, row, S_CHUNK: tl.constexpr, col0=0,
                    COLS: tl.constexpr = 512):
    """Partials ``first .. first + n - 1`` of one query row (each at ``index * rows_total + row``),
    S_CHUNK at a time (one [S_CHUNK, COLS] load each, columns ``col0 ..``): (sum_s 2^(lse_s - m)
    o_s, sum_s 2^(lse_s - m), m) with m the largest lse (0 where every lse is -inf). Partials were
    just written, so they come from L2; each loop step is one L2 round trip."""
    offs_s = tl.arange(0, S_CHUNK)
    offs_v = col0 + tl.arange(0, COLS)
    m = tl.full([S_CHUNK], float("-inf"), tl.float32)
    for s0 in range(0, n, S_CHUNK):
        part = (first + s0 + offs_s) * rows_total + row
        m = tl.maximum(m, tl.load(lseacc_ptr + part, mask=s0 + offs_s < n, other=float("-inf")))
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    total = tl.zeros([S_CHUNK], tl.float32)
    acc = tl.zeros([COLS], tl.float32)
    for s0 in range(0, n, S_CHUNK):
        part = (first + s0 + offs_s) * rows_total + row
        ok = s0 + offs_s < n
        w = tl.exp2(tl.load(lseacc_ptr + part, mask=ok, other=float("-inf")) - m_safe)
        total += w
        o = tl.load(oacc_ptr + part[:, None] * D_NOPE + offs_v[None, :], mask=ok[:, None], other=0.0)
        acc += tl.sum(w[:, None] * o, axis=0)
    return acc, tl.sum(total, axis=0), m_safe


@triton.jit
def _combine_row(oacc_ptr, lseacc_ptr, out_ptr, lse_ptr, req, row, first, n, h_q, rows_total,
                 stride_ob, stride_os, stride_oh, stride_lb, stride_lh, col0, S_CHUNK: tl.constexpr,
                 COLS: tl.constexpr):
    """One query row of the combine: its n partials merged (:func:`_merge_partials`), columns
    ``col0 .. col0 + COLS`` of the output stored, and its lse (natural log, +inf for a row with
    no visible key) by the columns' first program."""
    offs_v = col0 + tl.arange(0, COLS)
    acc, t, m_safe = _merge_partials(oacc_ptr, lseacc_ptr, first, n, rows_total, row, S_CHUNK, col0, COLS)
    t_safe = tl.where(t != 0, t, 1.0)
    lse2 = tl.where(t != 0, m_safe + tl.log2(t_safe), float("-inf"))
    tok = row // h_q
    head = row % h_q
    tl.store(out_ptr + req * stride_ob + tok * stride_os + head * stride_oh + offs_v,
             (acc / t_safe).to(out_ptr.dtype.element_ty))
    if col0 == 0:
        tl.store(lse_ptr + req * stride_lb + head * stride_lh + tok,
                 tl.where(lse2 == float("-inf"), float("inf"), lse2 * LN2))


@triton.jit
def mla_combine_kernel(
    num_splits_ptr, oacc_ptr, lseacc_ptr, out_ptr, lse_ptr,
    h_q, rows_total, num_slots,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    S_CHUNK: tl.constexpr, SLOT_PROGRAMS: tl.constexpr, FUSED_SPLITS: tl.constexpr = 1, GDC: tl.constexpr = False,
    COL_BLOCKS: tl.constexpr = 1, ROWS: tl.constexpr = 1,
):
    """The unfused combine: one program per (request, ``ROWS`` query rows, ``COL_BLOCKS``-th of
    the 512 columns) merges each row's partials (:func:`_combine_row`): out = sum_s 2^(lse_s - lse)
    o_s with lse = log2 sum_s 2^lse_s (written by the columns' first program). ``FUSED_SPLITS``
    (>= 1): requests of at most that many partials were written whole by the split kernel (one
    partial: its output; more: its fused combine), only longer ones are left here: a program of
    such a request ends after reading two split counts, which ``ROWS`` > 1 pays once for several
    rows (the rows then merged one after the other). ``GDC``: launched as a programmatic dependent
    launch after the split kernel: wait for its end before reading anything."""
    if GDC:
        gdc_wait()
    req = tl.program_id(0)
    COLS: tl.constexpr = D_NOPE // COL_BLOCKS
    col0 = tl.program_id(2) * COLS
    first_slot = tl.load(num_splits_ptr + req)
    next_slot = tl.load(num_splits_ptr + req + 1)
    # slots inside [0, num_slots], compared before any arithmetic (no overflow into range)
    in_range = (first_slot >= 0) & (first_slot < next_slot) & (next_slot <= num_slots)
    first = tl.where(in_range, first_slot, 0) * SLOT_PROGRAMS          # partials are per program
    n = tl.where(in_range, next_slot - first_slot, 0) * SLOT_PROGRAMS
    # up to FUSED_SPLITS partials (one: always): the split kernel wrote the result; out-of-range
    # num_splits: nothing was written
    if n > FUSED_SPLITS:
        if ROWS == 1:
            _combine_row(oacc_ptr, lseacc_ptr, out_ptr, lse_ptr, req, tl.program_id(1), first, n, h_q, rows_total,
                         stride_ob, stride_os, stride_oh, stride_lb, stride_lh, col0, S_CHUNK, COLS)
        else:
            for r in tl.static_range(ROWS):
                row = tl.program_id(1) * ROWS + r
                if row < rows_total:          # the last program's rows past the request's: none
                    _combine_row(oacc_ptr, lseacc_ptr, out_ptr, lse_ptr, req, row, first, n, h_q, rows_total,
                                 stride_ob, stride_os, stride_oh, stride_lb, stride_lh, col0, S_CHUNK, COLS)


@triton.jit
def _kv_group(k_rows, ok, g: tl.constexpr, KV_FP8: tl.constexpr, DTYPE: tl.constexpr):
    """Values ``g * 128 .. g * 128 + 128`` of the cached tokens at ``k_rows``: HBM -> registers as
    ``DTYPE`` [rows, 128], with their scale [rows] fp32. FP8 layout: the e4m3 codes unscaled
    (exact in 16 bits) and the group's fp32 scale, which the caller folds into S and P instead of
    multiplying 512 values per token; 16-bit caches: the values and a scale of 1. Rows where
    ``ok`` is false load as 0."""
    offs = g * FP8_GROUP + tl.arange(0, FP8_GROUP)
    if KV_FP8:
        codes = tl.load(k_rows[:, None] + offs[None, :], mask=ok[:, None], other=0)
        values = codes.to(tl.float8e4nv, bitcast=True).to(DTYPE)
        scale = tl.load((k_rows + D_NOPE).to(tl.pointer_type(tl.float32)) + g, mask=ok, other=0.0)
    else:
        values = tl.load(k_rows[:, None] + offs[None, :], mask=ok[:, None], other=0.0)
        scale = tl.full([k_rows.shape[0]], 1.0, tl.float32)
    return values, scale


@triton.jit
def _scores_group(s, q_g, v_g, scale_g, KV_FP8: tl.constexpr, DOT_PREC: tl.constexpr):
    """S += Q_g K_g^T for one 128-wide group, K_g's per-token scale applied to the columns."""
    if KV_FP8:
        return s + tl.dot(q_g, tl.trans(v_g), input_precision=DOT_PREC) * scale_g[None, :]
    return tl.dot(q_g, tl.trans(v_g), s, input_precision=DOT_PREC)


@triton.jit
def _output_group(acc_g, p, alpha, v_g, scale_g, KV_FP8: tl.constexpr, DOT_PREC: tl.constexpr,
                  KV_SHIFT: tl.constexpr = False):
    """O_g = O_g alpha + P V_g for one 128-wide group of V, V_g's per-token scale folded into P.
    ``KV_SHIFT`` (fp16 operands): P x scale can pass fp16's 65504 (large scales) or fall into its
    subnormals (small ones), so each row is divided by its largest term before the rounding to
    fp16 and the fp32 product multiplied back."""
    if KV_FP8:
        p = p * scale_g[None, :]
        if KV_SHIFT:
            top = tl.max(p, axis=1)
            top = tl.where(top > 0, top, 1.0)
            return acc_g * alpha[:, None] + tl.dot((p / top[:, None]).to(v_g.dtype), v_g,
                                                   input_precision=DOT_PREC) * top[:, None]
    return tl.dot(p.to(v_g.dtype), v_g, acc_g * alpha[:, None], input_precision=DOT_PREC)


@triton.jit
def _store_group(oacc_ptr, part, row_ok, acc_g, l_safe, g: tl.constexpr):
    offs = g * FP8_GROUP + tl.arange(0, FP8_GROUP)
    tl.store(oacc_ptr + part[:, None] * D_NOPE + offs[None, :], acc_g / l_safe[:, None], mask=row_ok[:, None])


@triton.jit
def mla_sparse_split_kernel(
    q_ptr, kc_ptr, idx_ptr, len_ptr, oacc_ptr, lseacc_ptr,
    h_q, s_q, topk, num_tokens, page, chunk_base, num_chunks, qk_scale,
    stride_qb, stride_qs, stride_qh, stride_kp, stride_kt, stride_ib, stride_is,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, HAS_LEN: tl.constexpr,
    KV_FP8: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Sparse (top-k) decode, one part: the BLOCK_H heads of tile ``pid 2`` of one query token
    (``pid 1`` = request x s_q + token) over the positions ``pid 0 x CHUNK ..`` of its index list
    (each index ``page * page_size + offset`` names one cached token; -1, an index outside the
    cache or a position past ``topk_length`` names none). Writes the part's normalised output and
    log2-sum-exp to the partials at ``chunk_base + pid 0``; ``mla_sparse_combine_kernel`` merges
    them. S = Q K^T ([BLOCK_H, BLOCK_N]), O = P V ([BLOCK_H, 512]), the 512-wide part in the FP8
    layout's four groups of 128 so that each group's scale multiplies S's and P's columns (BLOCK_N
    values per group) rather than the 512 values of every token: a gather kernel at few heads is
    bound by the work per gathered byte, not by the MMAs. An FP8 cache with an fp16 q
    (``KV_SHIFT``): the RoPE part and P x scale kept within fp16's range (:func:`_rope_shift`,
    :func:`_output_group`)."""
    # an FP8 cache read as fp16 (q's dtype): RoPE values and P x scale kept within fp16's range
    KV_SHIFT: tl.constexpr = KV_FP8 and q_ptr.dtype.element_ty == tl.float16
    chunk = tl.program_id(0)
    unit = tl.program_id(1)
    pid_h = tl.program_id(2)
    req = unit // s_q
    tok = unit % s_q
    rows = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < h_q
    offs_g = tl.arange(0, FP8_GROUP)
    offs_r = tl.arange(0, D_ROPE)
    # Q: HBM -> registers once, four [BLOCK_H, 128] groups + [BLOCK_H, 64]; padded heads load as 0.
    q_rows = q_ptr + req.to(tl.int64) * stride_qb + tok * stride_qs + rows * stride_qh
    q0 = tl.load(q_rows[:, None] + offs_g[None, :], mask=row_ok[:, None], other=0.0)
    q1 = tl.load(q_rows[:, None] + FP8_GROUP + offs_g[None, :], mask=row_ok[:, None], other=0.0)
    q2 = tl.load(q_rows[:, None] + 2 * FP8_GROUP + offs_g[None, :], mask=row_ok[:, None], other=0.0)
    q3 = tl.load(q_rows[:, None] + 3 * FP8_GROUP + offs_g[None, :], mask=row_ok[:, None], other=0.0)
    q_rope = tl.load(q_rows[:, None] + D_NOPE + offs_r[None, :], mask=row_ok[:, None], other=0.0)
    # This part's positions of the index list: [begin, end), the list cut to topk_length.
    n_valid = topk
    if HAS_LEN:
        n_valid = tl.minimum(tl.maximum(tl.load(len_ptr + req), 0), topk)
    begin = chunk * CHUNK
    end = tl.minimum(begin + CHUNK, n_valid)
    idx_row = idx_ptr + req.to(tl.int64) * stride_ib + tok * stride_is
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, FP8_GROUP], tl.float32)
    acc1 = tl.zeros([BLOCK_H, FP8_GROUP], tl.float32)
    acc2 = tl.zeros([BLOCK_H, FP8_GROUP], tl.float32)
    acc3 = tl.zeros([BLOCK_H, FP8_GROUP], tl.float32)
    rope_at = D_NOPE + 4 * FP8_GROUPS if KV_FP8 else D_NOPE        # bytes (FP8 layout) or elements
    for start in tl.range(begin, end, BLOCK_N):
        # ---- the tile's indices -> cache rows (a bad index reads row 0, masked: never used).
        pos = start + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_row + pos, mask=pos < end, other=-1).to(tl.int64)
        ok = (pos < end) & (idx >= 0) & (idx < num_tokens)
        slot = tl.where(ok, idx, 0)
        k_rows = kc_ptr + (slot // page) * stride_kp + (slot % page) * stride_kt
        # ---- HBM -> registers: four groups of 128 (codes and scales) and the RoPE part.
        v0, sc0 = _kv_group(k_rows, ok, 0, KV_FP8, q0.dtype)
        v1, sc1 = _kv_group(k_rows, ok, 1, KV_FP8, q0.dtype)
        v2, sc2 = _kv_group(k_rows, ok, 2, KV_FP8, q0.dtype)
        v3, sc3 = _kv_group(k_rows, ok, 3, KV_FP8, q0.dtype)
        rope_rows = (k_rows + rope_at).to(tl.pointer_type(tl.bfloat16)) if KV_FP8 else k_rows + rope_at
        k_rope = tl.load(rope_rows[:, None] + offs_r[None, :], mask=ok[:, None], other=0.0)
        # ---- S = Q K^T over the gathered tokens (unselected: -inf), then the online softmax.
        if KV_SHIFT:    # fp16: bf16 RoPE values past 65504 divided by a power of two, multiplied back in fp32
            k_rope = k_rope.to(tl.float32)
            r_shift = _rope_shift(k_rope)
            s = tl.dot(q_rope, tl.trans((k_rope / r_shift).to(q0.dtype)), input_precision=DOT_PREC) * r_shift
        else:
            s = tl.dot(q_rope, tl.trans(k_rope.to(q0.dtype)), input_precision=DOT_PREC)
        s = _scores_group(s, q0, v0, sc0, KV_FP8, DOT_PREC)
        s = _scores_group(s, q1, v1, sc1, KV_FP8, DOT_PREC)
        s = _scores_group(s, q2, v2, sc2, KV_FP8, DOT_PREC)
        s = _scores_group(s, q3, v3, sc3, KV_FP8, DOT_PREC)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        # ---- O = O alpha + P V, group by group.
        acc0 = _output_group(acc0, p, alpha, v0, sc0, KV_FP8, DOT_PREC, KV_SHIFT)
        acc1 = _output_group(acc1, p, alpha, v1, sc1, KV_FP8, DOT_PREC, KV_SHIFT)
        acc2 = _output_group(acc2, p, alpha, v2, sc2, KV_FP8, DOT_PREC, KV_SHIFT)
        acc3 = _output_group(acc3, p, alpha, v3, sc3, KV_FP8, DOT_PREC, KV_SHIFT)
    # ---- registers -> HBM: this part's normalised output and log2-sum-exp (-inf: no token).
    has_keys = l_i != 0
    l_safe = tl.where(has_keys, l_i, 1.0)
    part = (unit.to(tl.int64) * num_chunks + chunk_base + chunk) * h_q + rows
    _store_group(oacc_ptr, part, row_ok, acc0, l_safe, 0)
    _store_group(oacc_ptr, part, row_ok, acc1, l_safe, 1)
    _store_group(oacc_ptr, part, row_ok, acc2, l_safe, 2)
    _store_group(oacc_ptr, part, row_ok, acc3, l_safe, 3)
    tl.store(lseacc_ptr + part, tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf")), mask=row_ok)


@triton.jit
def mla_sparse_combine_kernel(
    oacc_ptr, lseacc_ptr, sink_ptr, out_ptr, lse_ptr,
    h_q, s_q, num_chunks,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    HAS_SINK: tl.constexpr, S_CHUNK: tl.constexpr,
):
    """One program per (query token, head): merges the token's parts, out = sum_s 2^(lse_s - lse)
    o_s with lse = log2 sum_s 2^lse_s; with ``attn_sink`` the output is scaled by
    exp(lse) / (exp(lse) + exp(sink)) (the sink joins the denominator only; the returned lse is
    the tokens' own). A head with no token gets out = 0 and lse = +inf."""
    unit = tl.program_id(0)
    head = tl.program_id(1)
    req = unit // s_q
    tok = unit % s_q
    offs_v = tl.arange(0, D_NOPE)
    acc, t, m_safe = _merge_partials(oacc_ptr, lseacc_ptr, unit.to(tl.int64) * num_chunks, num_chunks, h_q, head,
                                     S_CHUNK)
    has_keys = t != 0
    t_safe = tl.where(has_keys, t, 1.0)
    lse2 = m_safe + tl.log2(t_safe)
    out = acc / t_safe
    if HAS_SINK:
        # exp(lse) / (exp(lse) + exp(sink)) = 1 / (1 + 2^(sink log2(e) - lse2)); sink = +inf: 0
        sink2 = tl.load(sink_ptr + head) * LOG2E_K
        out = out / (1.0 + tl.exp2(sink2 - lse2))
    out = tl.where(has_keys, out, 0.0)
    tl.store(out_ptr + req.to(tl.int64) * stride_ob + tok * stride_os + head * stride_oh + offs_v,
             out.to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + req.to(tl.int64) * stride_lb + head * stride_lh + tok,
             tl.where(has_keys, lse2 * LN2, float("inf")))


@triton.jit
def _selected(idx_row, len_ptr, req, pos, end, num_tokens, HAS_LEN: tl.constexpr):
    """The index-list positions ``pos`` (< ``end``) of one query token: their indices (int64) and
    whether each names a cached token (an index in ``[0, num_tokens)`` at a position below the
    request's ``topk_length``)."""
    if HAS_LEN:
        end = tl.minimum(end, tl.maximum(tl.load(len_ptr + req), 0))
    idx = tl.load(idx_row + pos, mask=pos < end, other=-1).to(tl.int64)
    return idx, (pos < end) & (idx >= 0) & (idx < num_tokens)


@triton.jit
def mla_sparse_gather_kernel(
    kc_ptr, idx_ptr, len_ptr, prior_idx_ptr, prior_len_ptr, out_ptr, seqlens_ptr,
    s_q, topk, num_tokens, page, prior_topk, prior_num_tokens, unit_base, rows_per_unit, chunk_size,
    stride_kp, stride_kt, stride_ib, stride_is, stride_pb, stride_ps,
    BLOCK_T: tl.constexpr, COUNT: tl.constexpr, HAS_LEN: tl.constexpr, HAS_PRIOR: tl.constexpr,
    PRIOR_HAS_LEN: tl.constexpr, KV_FP8: tl.constexpr, LAST: tl.constexpr,
):
    """The sparse decode's selected tokens as a dense cache: program ``(c, u)`` copies the tokens
    that positions ``c x chunk_size ..`` (a multiple of BLOCK_T) of query token ``unit_base + u``'s
    index list name (HBM -> registers, dequantized from the FP8 layout into ``out``'s 16-bit dtype:
    exact, e4m3 times a power of two) to rows ``u x rows_per_unit + n`` of ``out`` [units x
    rows_per_unit, 576], where ``n`` counts the selected tokens before them (of an earlier source,
    ``prior_*``, then of this list), so each query token's selected tokens lie packed at the start
    of its rows and the unselected ones (-1, out of the cache, past ``topk_length``) are never
    read. With ``LAST``, the list's last program writes the count to ``seqlens[u]``: the dense
    decode's length."""
    chunk = tl.program_id(0)
    unit = unit_base + tl.program_id(1)
    req = unit // s_q
    tok = unit % s_q
    offs = tl.arange(0, BLOCK_T)
    wide = tl.arange(0, COUNT)
    # ---- how many selected tokens precede this part (index lists only, COUNT positions a step:
    # L2-resident int32 reads)
    count = tl.full([], 0, tl.int32)
    if HAS_PRIOR:
        prior_row = prior_idx_ptr + req.to(tl.int64) * stride_pb + tok * stride_ps
        for start in range(0, prior_topk, COUNT):
            _, ok = _selected(prior_row, prior_len_ptr, req, start + wide, prior_topk, prior_num_tokens,
                              PRIOR_HAS_LEN)
            count += tl.sum(ok.to(tl.int32), axis=0)
    idx_row = idx_ptr + req.to(tl.int64) * stride_ib + tok * stride_is
    begin = chunk * chunk_size
    for start in range(0, begin, COUNT):
        _, ok = _selected(idx_row, len_ptr, req, start + wide, begin, num_tokens, HAS_LEN)
        count += tl.sum(ok.to(tl.int32), axis=0)
    # ---- this part's tokens: cache rows -> registers (dequantized) -> packed dense rows
    dst_unit = out_ptr + tl.program_id(1).to(tl.int64) * rows_per_unit * (D_NOPE + D_ROPE)
    for start in range(begin, tl.minimum(begin + chunk_size, topk), BLOCK_T):
        idx, ok = _selected(idx_row, len_ptr, req, start + offs, topk, num_tokens, HAS_LEN)
        slot = tl.where(ok, idx, 0)
        k_nope, k_rope, _, _ = _kv_rows(kc_ptr + (slot // page) * stride_kp + (slot % page) * stride_kt, ok, KV_FP8,
                                        out_ptr.dtype.element_ty)
        dst = dst_unit + (count + tl.cumsum(ok.to(tl.int32), axis=0) - 1).to(tl.int64) * (D_NOPE + D_ROPE)
        tl.store(dst[:, None] + tl.arange(0, D_NOPE)[None, :], k_nope, mask=ok[:, None])
        tl.store(dst[:, None] + D_NOPE + tl.arange(0, D_ROPE)[None, :], k_rope, mask=ok[:, None])
        count += tl.sum(ok.to(tl.int32), axis=0)
    if LAST:
        if chunk == tl.num_programs(0) - 1:
            tl.store(seqlens_ptr + tl.program_id(1), count)


@triton.jit
def mla_scatter_rows_kernel(
    src_ptr, slot_ptr, dst_ptr,                 # [T, WIDTH] rows; [T] slots; [num_rows, WIDTH] cache rows
    num_rows,
    WIDTH: tl.constexpr, BLOCK: tl.constexpr,
):
    """``dst[slot[t]] = src[t]`` for every token t with ``0 <= slot[t] < num_rows`` (one program
    per token; -1 marks a token to skip, vLLM's convention): the cache write of a decode step,
    HBM -> HBM, without a host-side filter of the skipped tokens."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot >= 0) & (slot < num_rows):
        offs = tl.arange(0, BLOCK)
        row = tl.load(src_ptr + t.to(tl.int64) * WIDTH + offs, mask=offs < WIDTH)
        tl.store(dst_ptr + slot * WIDTH + offs, row, mask=offs < WIDTH)


@triton.jit
def _rope_pairs(src_ptr, cos_ptr, sin_ptr, cs_step, dst_ptr, MODE: tl.constexpr):
    """RoPE of the 64 values at ``src_ptr`` into the 64 at ``dst_ptr``, as DeepSeek's PyTorch code
    computes it: pairs ``(a, b)`` rotated by angle ``j`` (``cos``/``sin`` entries ``cs_step``
    apart), ``a' = a cos - b sin``, ``b' = b cos' + a sin'``.

    MODE 0 (V3 ``rope_interleave``): pairs ``(x[2j], x[2j+1])``, written de-interleaved (``a'`` to
    ``j``, ``b'`` to ``32 + j``); 1 (V3 halves): pairs ``(x[j], x[j+32])``, ``cos'``/``sin'`` the
    entries ``32 + j``; both in the model's 16-bit dtype, each product and sum rounded to it as
    PyTorch's elementwise ops round. MODE 2 (V2 complex rotations, fp32 ``cos``/``sin``): pairs
    ``(x[2j], x[2j+1])`` in fp32, written interleaved again, rounded once."""
    j = tl.arange(0, 32)
    if MODE == 1:
        ia, ib, jb = j, j + 32, j + 32          # input pair; the angle entry of b'
    else:
        ia, ib, jb = 2 * j, 2 * j + 1, j
    if MODE == 2:
        oa, ob = 2 * j, 2 * j + 1
    else:
        oa, ob = j, j + 32
    a_raw = tl.load(src_ptr + ia)
    dt = a_raw.dtype
    a = a_raw.to(tl.float32)
    b = tl.load(src_ptr + ib).to(tl.float32)
    ca = tl.load(cos_ptr + j * cs_step).to(tl.float32)
    sa = tl.load(sin_ptr + j * cs_step).to(tl.float32)
    cb = tl.load(cos_ptr + jb * cs_step).to(tl.float32)
    sb = tl.load(sin_ptr + jb * cs_step).to(tl.float32)
    if MODE == 2:
        out_a = a * ca - b * sa
        out_b = b * cb + a * sb
    else:   # every product and sum rounded to the 16-bit dtype (products of two 16-bit values are exact in fp32)
        out_a = (a * ca).to(dt).to(tl.float32) - (b * sa).to(dt).to(tl.float32)
        out_b = (b * cb).to(dt).to(tl.float32) + (a * sb).to(dt).to(tl.float32)
    tl.store(dst_ptr + oa, out_a.to(dst_ptr.dtype.element_ty))
    tl.store(dst_ptr + ob, out_b.to(dst_ptr.dtype.element_ty))


@triton.jit
def mla_decode_rows_kernel(
    q_lat_ptr,        # [H, R, 512] the absorbed query (q_nope @ W_UK per head), contiguous
    q_pe_ptr,         # row r, head h at q_pe_ptr + r * q_row + h * q_head: 64 RoPE inputs
    k_pe_ptr,         # row r at k_pe_ptr + r * k_row: the 64 RoPE inputs of the new key
    c_kv_ptr,         # [R, 512] the normalised latents, contiguous
    cos_ptr, sin_ptr,  # row r at + r * cs_row, entries cs_step apart
    slot_ptr,         # [R] cache row of each new token
    q_out_ptr,        # [R, H, 576] the query flash_mla_with_kvcache takes
    cache_ptr,        # [num_rows, 576] the layer's pages, flat
    H, q_row, q_head, k_row, cs_row, cs_step, num_rows,
    MODE: tl.constexpr,
):
    """The new tokens of a decode step into the two places the attention reads them, one launch
    instead of a dozen elementwise ops (an eager step is host-bound). Program ``(r, p)``:
    ``p < H`` writes query row ``(r, p)`` = its 512 absorbed values then its 64 RoPE'd ones;
    ``p == H`` writes token r's cache row = its 512 normalised latents then its RoPE'd key (rows
    outside ``[0, num_rows)`` skipped)."""
    r = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    offs = tl.arange(0, D_NOPE)
    if p < H:
        # query: the absorbed 512 from the bmm's head-major output, then RoPE of its 64
        R = tl.num_programs(0).to(tl.int64)
        dst = q_out_ptr + (r * H + p) * 576
        tl.store(dst + offs, tl.load(q_lat_ptr + (p * R + r) * D_NOPE + offs))
        _rope_pairs(q_pe_ptr + r * q_row + p * q_head, cos_ptr + r * cs_row, sin_ptr + r * cs_row, cs_step,
                    dst + D_NOPE, MODE)
    else:
        # cache row: the normalised latent, then the RoPE'd shared key
        slot = tl.load(slot_ptr + r).to(tl.int64)
        if (slot >= 0) & (slot < num_rows):
            dst = cache_ptr + slot * 576
            tl.store(dst + offs, tl.load(c_kv_ptr + r * D_NOPE + offs).to(cache_ptr.dtype.element_ty))
            _rope_pairs(k_pe_ptr + r * k_row, cos_ptr + r * cs_row, sin_ptr + r * cs_row, cs_step, dst + D_NOPE,
                        MODE)
