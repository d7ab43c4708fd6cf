"""2-bit MoE experts in three launches, routing read on the device: ``tilefuse.vq_moe``.

``y[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))`` with ``e = top_k_index[t, j]``,
every expert's ``[2I, H]`` gate/up weight (gate rows first, then up rows, one codebook pair) and
``[H, I]`` down weight in AQLM's 2x8 format, stacked along a leading expert dimension.

Per pair (``GROUPED`` off: decode sizes) the grid runs over (token-expert pair ``p = t * TOPK + j``,
row block): each program reads its pair's expert id from device memory (no host sync, so a CUDA
graph replays any routing), offsets the codes, codebooks and scales pointers by it and runs one
program of the small-layer kernels on its token's row. Grouped (``GROUPED``: many pairs) the grid
runs over (tile, row block), a tile being up to ``TOKENS`` pairs of one expert in the pairs'
expert-sorted order (:func:`vq_moe_schedule_kernel`, computed on the device): the program gathers its
tokens' rows of x (or h) into the MMA's columns, so an expert's codebooks are staged and its codes
read once per tile instead of once per pair, and scatters its outputs to the pairs' rows.

* :func:`vq_moe_gate_up_kernel`: ``kernels_swiglu.swiglu_program`` with the gate's and the up's
  rows of one expert weight (one codebook pair staged once: ``SHARED_BOOKS``) on ``x[t]``, writing
  ``h[p] = silu(g) * u`` (``[T * TOPK, I]``, x's dtype);
* :func:`vq_moe_down_kernel`: ``kernels_small.small_program`` on ``h[p]`` with the row scale times
  the routing weight ``w[t, j]`` (per column where grouped), writing ``y_p`` (``[T * TOPK, H]`` fp32);
* :func:`vq_moe_sum_kernel`: ``y[t] = sum_j y_{t*TOPK+j}`` in fp32 in ``j`` order, one rounding;
* :func:`vq_moe_schedule_kernel` (grouped, first): the tiles and the expert-sorted pairs in one
  program, bit-identical to ``op.moe_schedule``'s PyTorch ops;
* :func:`vq_moe_dequant_kernel` (the dequantize path at prefill sizes, ``op.launch_moe_dequant``):
  every expert's weight dequantized into a scratch ``[E, R, K]`` for PyTorch's grouped GEMM.

Nothing is split over programs (no workspace, no atomics): the result's bits do not depend on
what else runs. A pair whose expert id lies outside ``[0, NUM_EXPERTS)`` (transformers' expert-
parallel sentinel, or a bad id) contributes nothing: its programs load no x row (``M`` ends before
its token) and store nothing, and the sum skips it. The kernels read only the selected experts'
codes: ``1/8`` of their bf16 bytes.

Stages (of each program; details in ``kernels_small.py`` and ``kernels_swiglu.py``): stage 0 the
expert's codebooks into shared memory, ``COPIES`` copies; stage 1 the code pairs of its rows, one
step ahead; stage 2 the weight tiles from the copies (inline PTX) in ``mma.sync``'s A layout;
stage 3 the token's row of x (or h) times the tiles on tensor cores (a token tile of ``TOKENS``
columns of which one is used); stage 4 the warps' K slices summed in shared memory in a fixed
order, scales, epilogue, store.

The ``tl`` twins (:func:`vq_moe_gate_up_tl_kernel`, :func:`vq_moe_down_tl_kernel`) run the same
decomposition in the CPU interpreter.
"""

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tilefuse.ops.vq.kernels import dequant_tile
from tilefuse.ops.vq.kernels_small import small_program, tl_small_program
from tilefuse.ops.vq.kernels_swiglu import swiglu_program, tl_swiglu_program

CODEBOOK_VALUES = tl.constexpr(2 * 256 * 8)       # one expert's codebook pair, [2, 256, 1, 8]


@gluon.jit
def _pair(idx_ptr, p, TOPK, NUM_EXPERTS):
    """Pair ``p``'s token, expert (0 where out of range) and ``1`` if its id is in range else ``0``."""
    e = gl.load(idx_ptr + p).to(gl.int32)
    valid = ((e >= 0) & (e < NUM_EXPERTS)).to(gl.int32)
    return p // TOPK, (e * valid).to(gl.int64), valid


@gluon.jit
def _tile(sched_ptr, tau, NUM_TILES, NUM_EXPERTS):
    """Grouped tile ``tau``'s expert (clamped into range: an empty tile's id is E), first position
    in the expert-sorted pair order and token count (``op.moe_schedule``; device memory)."""
    e = gl.load(sched_ptr + tau)
    first = gl.load(sched_ptr + NUM_TILES + tau)
    count = gl.load(sched_ptr + 2 * NUM_TILES + tau)
    return gl.minimum(e, NUM_EXPERTS - 1).to(gl.int64), first, count


@gluon.jit
def vq_moe_gate_up_kernel(
    # x [T, H]; idx [T * TOPK] expert ids; codes int16 [E, 2I, H/8]; codebooks [E, 2, 256, 1, 8];
    # scales [E, 2I]; out h [T * TOPK, I]; GROUPED: the schedule [3, NUM_TILES] and the pairs
    # sorted by expert (their tokens in tok_ptr, their indices in pairs_ptr), int32
    x_ptr, idx_ptr, codes_ptr, cb_ptr, scales_ptr, out_ptr, sched_ptr, tok_ptr, pairs_ptr,
    NUM_EXPERTS, TOPK, I, NUM_GROUPS, GROUPS_PER_SLICE,
    stride_xm, stride_ce, stride_cn, stride_om, NUM_TILES,
    TOKENS: gl.constexpr, KREP: gl.constexpr, ROW_TILES: gl.constexpr, SLICES: gl.constexpr,
    COPIES: gl.constexpr, EVEN: gl.constexpr, GROUPED: gl.constexpr,
):
    if GROUPED:
        # grid: (tiles, row blocks of I); a tile = up to TOKENS tokens of one expert
        e, first, count = _tile(sched_ptr, gl.program_id(0), NUM_TILES, NUM_EXPERTS)
        codes = codes_ptr + e * stride_ce                 # the expert's gate rows, then its up rows
        books = cb_ptr + e * CODEBOOK_VALUES
        scales = scales_ptr + e * (2 * I)
        swiglu_program(x_ptr, codes, books, scales, scales, codes + I * stride_cn, books, scales + I, scales, out_ptr,
                       gl.program_id(1), 0, count, I, NUM_GROUPS, GROUPS_PER_SLICE, stride_xm, stride_cn, stride_om,
                       TOKENS, KREP, ROW_TILES, SLICES, COPIES, False, False, EVEN, True, tok_ptr + first,
                       pairs_ptr + first, True)
    else:
        # grid: (pairs, row blocks of I); the pair's expert from device memory
        p = gl.program_id(0)
        token, e, valid = _pair(idx_ptr, p, TOPK, NUM_EXPERTS)
        codes = codes_ptr + e * stride_ce
        books = cb_ptr + e * CODEBOOK_VALUES
        scales = scales_ptr + e * (2 * I)
        # x's row is the token's (M = token + 1, or token: nothing for an out-of-range expert); h's
        # row is the pair's: out offset by (p - token) rows, as the program stores at row m0 = token
        swiglu_program(x_ptr, codes, books, scales, scales, codes + I * stride_cn, books, scales + I, scales,
                       out_ptr + (p - token) * stride_om, gl.program_id(1), token, token + valid, I, NUM_GROUPS,
                       GROUPS_PER_SLICE, stride_xm, stride_cn, stride_om, TOKENS, KREP, ROW_TILES, SLICES, COPIES,
                       False, False, EVEN, True)


@gluon.jit
def vq_moe_down_kernel(
    # h [T * TOPK, I]; idx, weights [T * TOPK]; codes int16 [E, H, I/8]; codebooks [E, 2, 256, 1, 8];
    # scales [E, H]; out y_p [T * TOPK, H] fp32; GROUPED: the schedule and the sorted pairs
    h_ptr, idx_ptr, w_ptr, codes_ptr, cb_ptr, scales_ptr, out_ptr, sched_ptr, pairs_ptr,
    NUM_EXPERTS, TOPK, H, NUM_GROUPS, GROUPS_PER_SLICE,
    stride_hm, stride_ce, stride_cn, stride_om, NUM_TILES,
    TOKENS: gl.constexpr, KREP: gl.constexpr, ROW_TILES: gl.constexpr, SLICES: gl.constexpr,
    COPIES: gl.constexpr, EVEN: gl.constexpr, GROUPED: gl.constexpr,
):
    if GROUPED:
        # grid: (tiles, row blocks of H); h's rows and y's rows are the tile's pairs, each times its
        # routing weight
        e, first, count = _tile(sched_ptr, gl.program_id(0), NUM_TILES, NUM_EXPERTS)
        small_program(h_ptr, codes_ptr + e * stride_ce, cb_ptr + e * CODEBOOK_VALUES, scales_ptr + e * H,
                      scales_ptr, out_ptr, gl.program_id(1), 0, count, H, NUM_GROUPS, GROUPS_PER_SLICE, stride_hm,
                      stride_cn, stride_om, 1.0, TOKENS, KREP, ROW_TILES, SLICES, COPIES, False, EVEN,
                      pairs_ptr + first, pairs_ptr + first, w_ptr, True)
    else:
        # grid: (pairs, row blocks of H); the pair's expert and routing weight from device memory
        p = gl.program_id(0)
        token, e, valid = _pair(idx_ptr, p, TOPK, NUM_EXPERTS)
        weight = gl.load(w_ptr + p).to(gl.float32)
        small_program(h_ptr, codes_ptr + e * stride_ce, cb_ptr + e * CODEBOOK_VALUES, scales_ptr + e * H,
                      scales_ptr, out_ptr, gl.program_id(1), p, p + valid, H, NUM_GROUPS, GROUPS_PER_SLICE,
                      stride_hm, stride_cn, stride_om, weight, TOKENS, KREP, ROW_TILES, SLICES, COPIES, False, EVEN)


@triton.jit
def _tl_pair(idx_ptr, p, TOPK, NUM_EXPERTS):
    """:func:`_pair` in ``tl``."""
    e = tl.load(idx_ptr + p).to(tl.int32)
    valid = ((e >= 0) & (e < NUM_EXPERTS)).to(tl.int32)
    return p // TOPK, (e * valid).to(tl.int64), valid


@triton.jit
def _tl_tile(sched_ptr, tau, NUM_TILES, NUM_EXPERTS):
    """:func:`_tile` in ``tl``."""
    e = tl.load(sched_ptr + tau)
    first = tl.load(sched_ptr + NUM_TILES + tau)
    count = tl.load(sched_ptr + 2 * NUM_TILES + tau)
    return tl.minimum(e, NUM_EXPERTS - 1).to(tl.int64), first, count


@triton.jit
def vq_moe_gate_up_tl_kernel(
    x_ptr, idx_ptr, codes_ptr, cb_ptr, scales_ptr, out_ptr, sched_ptr, tok_ptr, pairs_ptr,
    NUM_EXPERTS, TOPK, I, NUM_GROUPS, GROUPS_PER_SLICE,
    stride_xm, stride_ce, stride_cn, stride_om, NUM_TILES,
    TOKENS: tl.constexpr, KREP: tl.constexpr, ROW_TILES: tl.constexpr, SLICES: tl.constexpr,
    COPIES: tl.constexpr, EVEN: tl.constexpr, GROUPED: tl.constexpr,
):
    """:func:`vq_moe_gate_up_kernel` in ``tl`` (the CPU-interpreted twin; same arguments)."""
    ROWS: tl.constexpr = 16 * ROW_TILES
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    j = tl.arange(0, TOKENS)
    if GROUPED:
        e, first, count = _tl_tile(sched_ptr, tl.program_id(0), NUM_TILES, NUM_EXPERTS)
        xrows = tl.load(tok_ptr + first + j, mask=j < count, other=0)
        out_toks = tl.load(pairs_ptr + first + j, mask=j < count, other=0)
        toks, m, out = j, count, out_ptr
    else:
        p = tl.program_id(0)
        token, e, valid = _tl_pair(idx_ptr, p, TOPK, NUM_EXPERTS)
        toks = token + j
        xrows, out_toks, m, out = toks, toks, token + valid, out_ptr + (p - token) * stride_om
    codes = codes_ptr + e * stride_ce
    books = cb_ptr + e * CODEBOOK_VALUES
    scales = scales_ptr + e * (2 * I)
    tl_swiglu_program(x_ptr, codes, books, scales, scales, codes + I * stride_cn, books, scales + I, scales, out,
                      rows, toks, xrows, out_toks, m, I, NUM_GROUPS, GROUPS_PER_SLICE, stride_xm, stride_cn, stride_om,
                      ROWS, TOKENS, 4 * KREP, SLICES, False, False)


@triton.jit
def vq_moe_down_tl_kernel(
    h_ptr, idx_ptr, w_ptr, codes_ptr, cb_ptr, scales_ptr, out_ptr, sched_ptr, pairs_ptr,
    NUM_EXPERTS, TOPK, H, NUM_GROUPS, GROUPS_PER_SLICE,
    stride_hm, stride_ce, stride_cn, stride_om, NUM_TILES,
    TOKENS: tl.constexpr, KREP: tl.constexpr, ROW_TILES: tl.constexpr, SLICES: tl.constexpr,
    COPIES: tl.constexpr, EVEN: tl.constexpr, GROUPED: tl.constexpr,
):
    """:func:`vq_moe_down_kernel` in ``tl`` (the CPU-interpreted twin; same arguments)."""
    ROWS: tl.constexpr = 16 * ROW_TILES
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    j = tl.arange(0, TOKENS)
    if GROUPED:
        e, first, count = _tl_tile(sched_ptr, tl.program_id(0), NUM_TILES, NUM_EXPERTS)
        toks = j
        pairs = tl.load(pairs_ptr + first + j, mask=j < count, other=0)
        weight = tl.load(w_ptr + pairs, mask=j < count, other=0.0).to(tl.float32)[None, :]
        m = count
    else:
        p = tl.program_id(0)
        token, e, valid = _tl_pair(idx_ptr, p, TOPK, NUM_EXPERTS)
        toks = p + j
        pairs = toks
        weight = tl.load(w_ptr + p).to(tl.float32)
        m = p + valid
    tl_small_program(h_ptr, codes_ptr + e * stride_ce, cb_ptr + e * CODEBOOK_VALUES, scales_ptr + e * H, scales_ptr,
                     out_ptr, rows, toks, pairs, pairs, m, H, NUM_GROUPS, GROUPS_PER_SLICE, stride_hm, stride_cn,
                     stride_om, weight, ROWS, TOKENS, 4 * KREP, SLICES, False)


@triton.jit
def vq_moe_sum_kernel(y_ptr, idx_ptr, out_ptr, NUM_EXPERTS, H, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    """``out[t] = sum_j y[t * TOPK + j]`` over the pairs whose expert id is in range, fp32 in ``j``
    order (bit-reproducible), one rounding to out's dtype. y: ``[T * TOPK, H]`` fp32 (rows of
    out-of-range pairs are never read); out: ``[T, H]``. Grid: (tokens, blocks of BLOCK columns)."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        # the pair's expert id (device memory), then its weighted down projection (L2 -> registers)
        p = t * TOPK + j
        e = tl.load(idx_ptr + p)
        valid = ((e >= 0) & (e < NUM_EXPERTS)).to(tl.int32)
        # (the id's test broadcast over the columns: Triton 3.9's interpreter takes no scalar in a mask)
        keep = ok & ((cols * 0 + valid) != 0)
        acc += tl.load(y_ptr + p.to(tl.int64) * H + cols, mask=keep, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * H + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _schedule_keys(idx_ptr, offs, in_range, NUM_EXPERTS):
    """The sort keys of pairs ``offs``: their expert ids, ``NUM_EXPERTS`` for ids outside ``[0, E)``
    (compared in the ids' own dtype) and for the lanes past the pairs, int32."""
    e = tl.load(idx_ptr + offs, mask=in_range, other=-1)
    return tl.where((e >= 0) & (e < NUM_EXPERTS), e, NUM_EXPERTS).to(tl.int32)


@triton.jit
def vq_moe_schedule_kernel(
    # idx [P] expert ids (int32 or int64); sched [3, NUM_TILES], tok and pairs [P]: int32 outputs
    idx_ptr, sched_ptr, tok_ptr, pairs_ptr,
    P, NUM_EXPERTS, TOPK, TOKENS, NUM_TILES,
    EXPERTS: tl.constexpr, LOG_EXPERTS: tl.constexpr, BLOCK: tl.constexpr,
):
    """``op.moe_schedule`` in one program (grid ``(1,)``), bit-identical to it: the pairs'
    stable sort by expert id (ids outside ``[0, E)`` last), then the tiles of ``TOKENS`` pairs of
    one expert. ``EXPERTS``: a power of two above ``NUM_EXPERTS`` (bins of the ids and the
    out-of-range key ``NUM_EXPERTS``); ``BLOCK``: pairs (and tiles) per step, a power of two.
    Integer counts (the histogram's shared-memory adds are exact in any order), scans and a sort:
    the outputs do not depend on timing."""
    lane = tl.arange(0, BLOCK)
    bins = tl.arange(0, EXPERTS)
    # stage 1: per-expert pair counts (histogram of the keys, a block of pairs at a time)
    counts = tl.zeros([EXPERTS], dtype=tl.int32)
    for b in range(0, P, BLOCK):
        in_range = b + lane < P
        counts += tl.histogram(_schedule_keys(idx_ptr, b + lane, in_range, NUM_EXPERTS), EXPERTS, mask=in_range)
    # stage 2: each expert's first position in the sorted order (exclusive scan over experts)
    start = tl.cumsum(counts, 0) - counts
    # stage 3: the stable counting sort. Per block: the keys sorted with their lane (key * BLOCK +
    # lane: equal keys keep their pair order); a pair's rank among its block's pairs of its expert
    # is its sorted lane minus the block's pairs of smaller keys; its position adds the pairs of
    # its expert in earlier blocks (``base``, the running start)
    base = start
    for b in range(0, P, BLOCK):
        in_range = b + lane < P
        key = _schedule_keys(idx_ptr, b + lane, in_range, NUM_EXPERTS)
        hist = tl.histogram(key, EXPERTS, mask=in_range)
        shift = base - (tl.cumsum(hist, 0) - hist)
        ordered = tl.sort(key * BLOCK + lane)
        pair = b + ordered % BLOCK
        pos = tl.gather(shift, ordered // BLOCK, 0) + lane
        valid = pair < P
        tl.store(pairs_ptr + pos, pair, mask=valid)
        tl.store(tok_ptr + pos, pair // TOPK, mask=valid)
        base += hist
    # stage 4: tiles per expert ceil(count / TOKENS) (none for the out-of-range key), their ends
    # (inclusive scan), and per expert the first position of tile tau minus tau * TOKENS, and its
    # pairs' end
    tiles = tl.where(bins < NUM_EXPERTS, (counts + TOKENS - 1) // TOKENS, 0)
    tile_end = tl.cumsum(tiles, 0)
    offset = start - (tile_end - tiles) * TOKENS
    end = start + counts
    # stage 5: per tile its expert (the experts whose tiles end at or before it, a branchless
    # binary search over the non-decreasing tile ends, at most EXPERTS - 1 >= E; E past the
    # last tile), first position and count
    for t0 in range(0, NUM_TILES, BLOCK):
        tau = t0 + lane
        below = tl.zeros([BLOCK], dtype=tl.int32)
        for s in tl.static_range(LOG_EXPERTS):
            step = EXPERTS >> (s + 1)
            below = tl.where(tl.gather(tile_end, below + (step - 1), 0) <= tau, below + step, below)
        expert = tl.minimum(below, NUM_EXPERTS)
        clamped = tl.minimum(expert, NUM_EXPERTS - 1)
        first = tl.gather(offset, clamped, 0) + tau * TOKENS
        count = tl.where(expert < NUM_EXPERTS,
                         tl.minimum(tl.maximum(tl.gather(end, clamped, 0) - first, 0), TOKENS), 0)
        ok = tau < NUM_TILES
        tl.store(sched_ptr + tau, expert, mask=ok)
        tl.store(sched_ptr + NUM_TILES + tau, tl.minimum(tl.maximum(first, 0), P), mask=ok)
        tl.store(sched_ptr + 2 * NUM_TILES + tau, count, mask=ok)


@triton.jit
def vq_moe_dequant_kernel(
    # codes uint8 [E, N, K/8, 2]; codebooks [E, 2, 256, 1, 8]; scales [E, N]; w [E, N, K] (x's dtype)
    codes_ptr, cb_ptr, scales_ptr, w_ptr,
    N, NUM_GROUPS, stride_cn, stride_wn, stride_ce, stride_we,
    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
):
    """Every expert's ``W_e[n, 8g:8g+8] = scale_e[n] * (C0_e[c0] + C1_e[c1])``: the dequantize
    kernel's tile (``kernels.dequant_tile``: codes streamed once, codebook rows gathered from L1,
    fp32 sums, one rounding per weight) with the expert's codes, codebooks, scales and output
    offset by the grid's third axis. Grid: (row blocks, group blocks, experts)."""
    e = tl.program_id(2).to(tl.int64)
    dequant_tile(codes_ptr + e * stride_ce, cb_ptr + e * CODEBOOK_VALUES, scales_ptr + e * N, w_ptr + e * stride_we,
                 N, NUM_GROUPS, stride_cn, stride_wn, tl.program_id(0), tl.program_id(1), BLOCK_N, BLOCK_G)
