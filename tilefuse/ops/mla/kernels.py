"""Triton kernels for MLA decode attention over a paged latent cache.

Three launches per decode step, all sized from static shapes so the step can be captured in a
CUDA graph and replayed with new lengths:

1. ``mla_metadata_kernel`` (one program): split the KV pages of the whole batch into chunks of
   equal size, one chunk per *slot*, and write where each slot starts and ends.
2. ``mla_split_standard_kernel`` / ``mla_split_transposed_kernel`` (one program per slot and head
   tile): attention of the query rows of one request over one chunk of its pages. A request that
   got one slot writes its final output; otherwise the slot writes a partial (normalised output,
   log-sum-exp) for the combine.
3. ``mla_combine_kernel`` (one program per request and query row): merges the partials of the
   requests that were split, weighting each by ``exp(lse_split - lse)``.

Query rows: the ``s_q * h_q`` (token, head) pairs of one request, row ``r = t * h_q + h``.
Scores are kept in the log2 domain (``qk_scale = softmax_scale * log2(e)``), so the softmax uses
``exp2``; the returned lse is converted back to the natural log.
"""

import triton
import triton.language as tl

PAGE = tl.constexpr(64)       # tokens per cache page (FlashMLA's block size)
D_NOPE = tl.constexpr(512)    # latent part of the 576-wide vector: the K "nope" part and all of V
D_ROPE = tl.constexpr(64)     # RoPE part, only in K
LOG2E = 1.4426950408889634    # host side: qk_scale = softmax_scale * LOG2E
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def mla_metadata_kernel(
    seqlens_ptr, meta_ptr, num_splits_ptr,      # [b] int32 in; [num_slots, 4] and [b + 1] int32 out
    batch, num_parts, num_slots,                # sizes: num_parts = target number of chunks
    BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr,
):
    # The whole batch's lengths fit in one program's registers (BLOCK_B = next_pow2(b)).
    offs_b = tl.arange(0, BLOCK_B)
    lens = tl.load(seqlens_ptr + offs_b, mask=offs_b < batch, other=0)
    pages = (lens + PAGE - 1) // PAGE
    # Equal chunks of `chunk` pages over the batch: sum(ceil(n_i / chunk)) <= num_parts + b slots.
    total = tl.sum(pages, axis=0)
    chunk = tl.maximum((total + num_parts - 1) // num_parts, 1)
    splits = tl.where(offs_b < batch, tl.maximum((pages + chunk - 1) // chunk, 1), 0)
    cu_end = tl.cumsum(splits, axis=0)          # inclusive prefix sum: slots of requests 0..i
    cu_begin = cu_end - splits
    tl.store(num_splits_ptr + offs_b, cu_begin, mask=offs_b < batch)
    tl.store(num_splits_ptr + batch, tl.sum(splits, axis=0))
    # Each slot p belongs to the request i with cu_begin[i] <= p < cu_end[i]; found by counting,
    # gathers done as masked sums over the batch axis (registers cannot be indexed).
    for p0 in range(0, num_slots, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        owns = (cu_begin[None, :] <= offs_p[:, None]) & (offs_p[:, None] < cu_end[None, :])   # [P, B]
        req = tl.sum(tl.where(owns, offs_b[None, :], 0), axis=1)
        local = offs_p - tl.sum(tl.where(owns, cu_begin[None, :], 0), axis=1)
        n_pages = tl.sum(tl.where(owns, pages[None, :], 0), axis=1)
        n_split = tl.sum(tl.where(owns, splits[None, :], 0), axis=1)
        valid = tl.sum(owns.to(tl.int32), axis=1) > 0
        begin = tl.minimum(local * chunk, n_pages)
        end = tl.minimum(begin + chunk, n_pages)
        row = meta_ptr + offs_p * 4
        in_range = offs_p < num_slots
        tl.store(row + 0, tl.where(valid, req, -1), mask=in_range)
        tl.store(row + 1, tl.where(valid, begin, 0), mask=in_range)
        tl.store(row + 2, tl.where(valid, end, 0), mask=in_range)
        tl.store(row + 3, tl.where(valid, n_split, 0), mask=in_range)


@triton.jit
def _slot_work(meta_ptr, seqlens_ptr, max_tokens, s_q, pid_slot):
    """(request, first token, end token, length, splits of the request) of one slot."""
    req = tl.load(meta_ptr + pid_slot * 4)
    page_begin = tl.load(meta_ptr + pid_slot * 4 + 1)
    page_end = tl.load(meta_ptr + pid_slot * 4 + 2)
    n_split = tl.load(meta_ptr + pid_slot * 4 + 3)
    length = tl.minimum(tl.load(seqlens_ptr + tl.maximum(req, 0)), max_tokens)  # never past the table
    tok_end = tl.minimum(page_end * PAGE, length)
    return req, page_begin * PAGE, tok_end, length, n_split


@triton.jit
def _write_result(acc, l_i, m_i, rows, row_ok, offs_v, req, pid_slot, n_split, h_q, s_q,
                  out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, rows_total,
                  stride_ob, stride_os, stride_oh, stride_lb, stride_lh):
    """Normalise the [rows, 512] accumulator; final output if the request has one slot, else a partial."""
    has_keys = l_i > 0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * LN2, float("-inf"))
    if n_split == 1:
        tok = rows // h_q
        head = rows % h_q
        o_ptrs = out_ptr + req * stride_ob + tok[:, None] * stride_os + head[:, None] * stride_oh + offs_v[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        final_lse = tl.where(has_keys, lse, float("inf"))   # no visible key: lse = +inf (FlashMLA)
        tl.store(lse_ptr + req * stride_lb + head * stride_lh + tok, final_lse, mask=row_ok)
    else:
        base = pid_slot * rows_total + rows
        tl.store(oacc_ptr + base[:, None] * D_NOPE + offs_v[None, :], o, mask=row_ok[:, None])
        tl.store(lseacc_ptr + base, lse, mask=row_ok)


@triton.jit
def mla_split_standard_kernel(
    q_ptr, kc_ptr, bt_ptr, seqlens_ptr, meta_ptr,
    out_ptr, lse_ptr, oacc_ptr, lseacc_ptr,
    h_q, s_q, rows_total, max_tokens, qk_scale,
    stride_qb, stride_qs, stride_qh, stride_kp, stride_kt, stride_btb,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    CAUSAL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Heads as the MMA's M dimension: S = Q K^T ([BLOCK_H, BLOCK_N]), O = P V ([BLOCK_H, 512]).

    BLOCK_H = 64 query rows per program so Hopper's WGMMA (M = 64) applies; the [64, 512] fp32
    accumulator is 128 registers per thread at num_warps = 8.
    """
    pid_slot = tl.program_id(0)
    pid_h = tl.program_id(1)
    req, tok_begin, tok_end, length, n_split = _slot_work(meta_ptr, seqlens_ptr, max_tokens, s_q, pid_slot)
    if req < 0:
        return
    rows = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < rows_total
    tok = rows // h_q
    # Last key position each row may see (causal: query token t of s_q is at L - s_q + t).
    limit = length - 1 - tl.where(CAUSAL, s_q - 1 - tok, 0)
    offs_v = tl.arange(0, D_NOPE)
    offs_r = tl.arange(0, D_ROPE)
    offs_n = tl.arange(0, BLOCK_N)
    # Q: HBM -> registers once, [BLOCK_H, 512] + [BLOCK_H, 64]; padded rows load as 0.
    q_rows = q_ptr + req * stride_qb + tok * stride_qs + (rows % h_q) * stride_qh
    q_nope = tl.load(q_rows[:, None] + offs_v[None, :], mask=row_ok[:, None], other=0.0)
    q_rope = tl.load(q_rows[:, None] + D_NOPE + offs_r[None, :], mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_NOPE], tl.float32)
    for start in tl.range(tok_begin, tok_end, BLOCK_N):
        # One page (or part of one) per step: BLOCK_N divides 64, so the page index is a scalar.
        page = tl.load(bt_ptr + req * stride_btb + start // PAGE).to(tl.int64)
        pos = start + offs_n
        in_len = pos < length                       # slots past the length may hold NaN: never read
        k_rows = kc_ptr + page * stride_kp + (pos % PAGE) * stride_kt
        # K tile: HBM -> SMEM (pipelined by num_stages); the 512-wide part is V as well.
        k_nope = tl.load(k_rows[:, None] + offs_v[None, :], mask=in_len[:, None], other=0.0)
        k_rope = tl.load(k_rows[:, None] + D_NOPE + offs_r[None, :], mask=in_len[:, None], other=0.0)
        s = tl.dot(q_nope, tl.trans(k_nope), input_precision=DOT_PREC)
        s = tl.dot(q_rope, tl.trans(k_rope), s, input_precision=DOT_PREC)
        s = tl.where(pos[None, :] <= limit[:, None], s * qk_scale, float("-inf"))
        # Online softmax over the KV axis (rows with no key yet keep m = -inf, p = 0).
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(k_nope.dtype), k_nope, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
    _write_result(acc, l_i, m_i, rows, row_ok, offs_v, req, pid_slot, n_split, h_q, s_q,
                  out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, rows_total,
                  stride_ob, stride_os, stride_oh, stride_lb, stride_lh)


@triton.jit
def mla_split_transposed_kernel(
    q_ptr, kc_ptr, bt_ptr, seqlens_ptr, meta_ptr,
    out_ptr, lse_ptr, oacc_ptr, lseacc_ptr,
    h_q, s_q, rows_total, max_tokens, qk_scale,
    stride_qb, stride_qs, stride_qh, stride_kp, stride_kt, stride_btb,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    CAUSAL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """ETAP: the KV length as the MMA's M dimension. S^T = K Q^T ([BLOCK_N, BLOCK_H]), softmax over
    axis 0, O^T = V^T P^T ([512, BLOCK_H]). For s_q * h_q < 64 nothing is padded to 64 rows: the
    dots have M = BLOCK_N (64) and M = 512, N = BLOCK_H (16 or 32)."""
    pid_slot = tl.program_id(0)
    pid_h = tl.program_id(1)
    req, tok_begin, tok_end, length, n_split = _slot_work(meta_ptr, seqlens_ptr, max_tokens, s_q, pid_slot)
    if req < 0:
        return
    rows = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < rows_total
    tok = rows // h_q
    limit = length - 1 - tl.where(CAUSAL, s_q - 1 - tok, 0)
    offs_v = tl.arange(0, D_NOPE)
    offs_r = tl.arange(0, D_ROPE)
    offs_n = tl.arange(0, BLOCK_N)
    # Q^T: HBM -> registers once, [512, BLOCK_H] + [64, BLOCK_H].
    q_rows = q_ptr + req * stride_qb + tok * stride_qs + (rows % h_q) * stride_qh
    qt_nope = tl.load(q_rows[None, :] + offs_v[:, None], mask=row_ok[None, :], other=0.0)
    qt_rope = tl.load(q_rows[None, :] + D_NOPE + offs_r[:, None], mask=row_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_t = tl.zeros([D_NOPE, BLOCK_H], tl.float32)
    for start in tl.range(tok_begin, tok_end, BLOCK_N):
        page = tl.load(bt_ptr + req * stride_btb + start // PAGE).to(tl.int64)
        pos = start + offs_n
        in_len = pos < length
        k_rows = kc_ptr + page * stride_kp + (pos % PAGE) * stride_kt
        k_nope = tl.load(k_rows[:, None] + offs_v[None, :], mask=in_len[:, None], other=0.0)
        k_rope = tl.load(k_rows[:, None] + D_NOPE + offs_r[None, :], mask=in_len[:, None], other=0.0)
        s_t = tl.dot(k_nope, qt_nope, input_precision=DOT_PREC)
        s_t = tl.dot(k_rope, qt_rope, s_t, input_precision=DOT_PREC)
        s_t = tl.where(pos[:, None] <= limit[None, :], s_t * qk_scale, float("-inf"))
        # Online softmax down the KV axis (axis 0).
        m_new = tl.maximum(m_i, tl.max(s_t, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p_t = tl.exp2(s_t - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(p_t, axis=0)
        acc_t = tl.dot(tl.trans(k_nope), p_t.to(k_nope.dtype), acc_t * alpha[None, :], input_precision=DOT_PREC)
        m_i = m_new
    _write_result(tl.trans(acc_t), l_i, m_i, rows, row_ok, offs_v, req, pid_slot, n_split, h_q, s_q,
                  out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, rows_total,
                  stride_ob, stride_os, stride_oh, stride_lb, stride_lh)


@triton.jit
def mla_combine_kernel(
    num_splits_ptr, oacc_ptr, lseacc_ptr, out_ptr, lse_ptr,
    h_q, rows_total,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    BLOCK_S: tl.constexpr,
):
    """out = sum_s exp(lse_s - lse) * o_s with lse = log sum_s exp(lse_s), for one (request, row).

    Partials are small and were just written, so they are read back from L2, not HBM.
    """
    req = tl.program_id(0)
    row = tl.program_id(1)
    first = tl.load(num_splits_ptr + req)
    n = tl.load(num_splits_ptr + req + 1) - first
    if n <= 1:
        return                                    # one slot: the split kernel wrote the result
    offs_s = tl.arange(0, BLOCK_S)
    offs_v = tl.arange(0, D_NOPE)
    acc = tl.zeros([D_NOPE], tl.float32)
    m = tl.full([], float("-inf"), tl.float32)
    for s0 in range(0, n, BLOCK_S):               # BLOCK_S >= n almost always: one step
        lse_s = tl.load(lseacc_ptr + (first + s0 + offs_s) * rows_total + row, mask=s0 + offs_s < n,
                        other=float("-inf"))
        m = tl.maximum(m, tl.max(lse_s, axis=0))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([], tl.float32)
    for s in range(0, n):
        w = tl.exp(tl.load(lseacc_ptr + (first + s) * rows_total + row) - m_safe)
        total += w
        acc += w * tl.load(oacc_ptr + ((first + s) * rows_total + row) * D_NOPE + offs_v)
    has_keys = total > 0
    o = acc / tl.where(has_keys, total, 1.0)
    lse = tl.where(has_keys, m_safe + tl.log(tl.where(has_keys, total, 1.0)), float("inf"))
    tok = row // h_q
    head = row % h_q
    tl.store(out_ptr + req * stride_ob + tok * stride_os + head * stride_oh + offs_v, o.to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + req * stride_lb + head * stride_lh + tok, lse)
