"""``tl`` building blocks shared by the families' Triton kernels.

* :func:`grouped_tile` -- the grouped (L2-friendly) order of output tiles, for the persistent
  SwiGLU kernel and the VQ prefill kernel.
* :func:`arrive` -- the split-K arrival: a program publishes its partial results, takes a ticket,
  and learns whether it is the last of its tile (the one that finishes it).
* :func:`split_k_tile`, :func:`load_gate_up_step` and :func:`split_k_gate_up` -- a program's
  output tile and K slice, a K step's loads, and the split-K fix-up of a gate/up tile pair, for
  the SwiGLU decode kernels (bf16 and FP8).
* :func:`quantize_rows` -- a tile's rows re-quantized to e4m3 with one scale per row (1 x 128
  output groups), and :func:`store_h`, a SwiGLU output tile stored rounded or so re-quantized,
  for the FP8 SwiGLU kernels and the SiLU·mul pass of the unfused paths.
"""

import triton
import triton.language as tl


@triton.jit
def grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of linear tile ``tile_id``: GROUP_M row-tiles sweep the N tiles together, so
    a weight tile loaded by one program is still in L2 when the other GROUP_M - 1 programs of its
    group need it."""
    group_size = GROUP_M * num_pid_n
    first_m = (tile_id // group_size) * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % group_size) % rows
    pid_n = (tile_id % group_size) // rows
    return pid_m, pid_n


@triton.jit
def arrive(counter_ptr, count, expected):
    """Add ``count`` to the tile's counter after every thread's partial-result stores/atomics are
    issued (CTA barrier, then an acq_rel atomic: release of this program's partials, acquire of
    the others'). True for the program whose arrival completes ``expected``; that program reads
    the partials and must re-arm the counter to 0."""
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, count, sem="acq_rel") + count == expected


@triton.jit
def split_k_tile(M, I, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr):
    """This program's work in a (cdiv(I, BLOCK_N), cdiv(M, BLOCK_M), SPLIT_K) grid: (pid_m, pid_n,
    pid_k, offs_m, offs_n, rows, cols, k_begin, k_end). ``rows`` / ``cols`` are ``offs_m`` /
    ``offs_n`` clamped to the last valid one (loads stay in bounds without masks; the store mask
    drops those results); K steps ``[k_begin, k_end)`` of BLOCK_K, whole steps per slice."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_steps, SPLIT_K)
    k_begin = pid_k * per_split
    k_end = tl.minimum(k_begin + per_split, k_steps)
    return (pid_m, pid_n, pid_k, offs_m, offs_n, tl.minimum(offs_m, M - 1), tl.minimum(offs_n, I - 1), k_begin,
            k_end)


@triton.jit
def load_gate_up_step(x_ptrs, wg_ptrs, wu_ptrs, ks, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, rows_ok,
                      MASK_ROWS: tl.constexpr):
    """HBM -> registers: K step ``ks`` of x [BM, BLOCK_K] and of the gate and up weight rows
    [BN, BLOCK_K] (the pointers already at the step), columns past K as zero unless EVEN_K; with
    MASK_ROWS, x rows where ``rows_ok`` [BM] is false as zero (not loaded)."""
    k_ok = (ks * BLOCK_K + tl.arange(0, BLOCK_K)) < K
    if MASK_ROWS:
        x_ok = rows_ok[:, None] if EVEN_K else rows_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptrs, mask=x_ok, other=0.0)
    elif EVEN_K:
        x = tl.load(x_ptrs)
    else:
        x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
    if EVEN_K:
        wg = tl.load(wg_ptrs)
        wu = tl.load(wu_ptrs)
    else:
        wg = tl.load(wg_ptrs, mask=k_ok[None, :], other=0.0)
        wu = tl.load(wu_ptrs, mask=k_ok[None, :], other=0.0)
    return x, wg, wu


@triton.jit
def split_k_gate_up(acc_g, acc_u, part_ptr, lock_ptr, tile, pid_k, plane, offs, mask, SPLIT_K: tl.constexpr):
    """Split-K fix-up of a [BLOCK_M, BLOCK_N] gate/up tile pair: park this K slice's fp32 partials
    in the workspace ``part_ptr`` ([SPLIT_K, 2, plane] with ``plane = M * I``, element ``offs``),
    take a ticket for ``tile``; the last slice to arrive sums all SPLIT_K partials, its own
    included, in slice order (so the result does not depend on which slice arrived last: eager
    calls and graph replays agree bit for bit), and re-arms the ticket (the counters stay zero
    between calls and CUDA-graph replays).
    Returns (last, gate sums, up sums): only the last slice's sums are whole."""
    tl.store(part_ptr + (2 * pid_k) * plane + offs, acc_g, mask=mask)
    tl.store(part_ptr + (2 * pid_k + 1) * plane + offs, acc_u, mask=mask)
    last = arrive(lock_ptr + tile, 1, SPLIT_K)
    if last:
        acc_g = tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
        acc_u = tl.load(part_ptr + plane + offs, mask=mask, other=0.0, cache_modifier=".cg")
        for s in range(1, SPLIT_K):
            acc_g += tl.load(part_ptr + (2 * s) * plane + offs, mask=mask, other=0.0, cache_modifier=".cg")
            acc_u += tl.load(part_ptr + (2 * s + 1) * plane + offs, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(lock_ptr + tile, 0)
    return last, acc_g, acc_u


FP8_MAX = tl.constexpr(448.0)   # largest finite e4m3 value


@triton.jit
def quantize_rows(h):
    """registers: each row of ``h`` [BM, 128] (one output group) as e4m3 values (still fp32,
    clamped to +-448 so a rounding overshoot cannot make NaN) and its scale ``amax / 448`` (1 for
    an all-zero group)."""
    amax = tl.max(tl.abs(h), axis=1)
    scale = tl.where(amax > 0, amax / FP8_MAX, 1.0)
    return tl.clamp(h / scale[:, None], -FP8_MAX, FP8_MAX), scale


@triton.jit
def store_h(h, out_ptr, os_ptr, offs_m, offs_n, stride_om, stride_os_m, group, mask, M, QUANT_OUT: tl.constexpr):
    """registers -> HBM: an output tile ``h`` [BM, BN] (fp32) at rows ``offs_m`` and columns
    ``offs_n`` of ``out``, rounded once to its dtype, or (``QUANT_OUT``, BN = 128) re-quantized
    per row with its scale stored at column ``group`` of ``os [M, I/128]``."""
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if QUANT_OUT:
        q, scale = quantize_rows(h)
        tl.store(out_ptrs, q.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(os_ptr + offs_m * stride_os_m + group, scale, mask=offs_m < M)
    else:
        tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=mask)
