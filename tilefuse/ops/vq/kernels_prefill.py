"""Gluon prefill kernel for Hopper: weight tiles dequantized straight into WGMMA's register operand.

``y[m, n] = scale[n] * sum_k W'[n, k] x[m, k] (+ bias[n])`` with
``W'[n, 8g:8g+8] = C0[c0(n, g)] + C1[c1(n, g)]`` (sm_90a). Swap-AB like the MMA decode kernel:
the weight tile ``[BLOCK_N rows, 64]`` is the A operand of ``wgmma`` *from registers*, x^T
``[64, BLOCK_M tokens]`` the B operand from shared memory, so the dequantized weights never go
through shared memory (a dequantize-to-SMEM GEMM would write and re-read 16 bytes per 8 weights
on top of the lookups and bind on shared-memory bandwidth).

* Stage 0 (HBM/L2 -> SMEM, once per program): both codebooks in x's dtype, every entry stored 8
  times side by side, the two codebooks interleaved (``[256 codes, 2 codebooks, 8 copies, 8]``,
  64 KB: 256 bytes per code), times a power of two ``f`` that is 1 unless ``C0[a] + C1[b]`` could
  overflow x's dtype (``kernels_mma.codebook_factor`` and the note above it; the row scale is
  multiplied by ``1 / f`` in stage 5).
* Stage 1 (HBM -> SMEM, TMA ring of ``STAGES`` slots, one mbarrier each): per 64-input K step the
  x box ``[BLOCK_M, 64]`` and the code box ``[BLOCK_N rows, 8 groups]`` (int16 pairs, low byte
  codebook 0), ``STAGES`` steps ahead; tokens and rows past the ends arrive as zeros.
* Stage 2 (SMEM -> registers): a thread's code pairs, 8 consecutive groups of each of its rows
  (one 16-byte shared load per row; the four lanes of a row quad read the same bytes).
* Stage 3 (SMEM -> registers): the A tile in WGMMA's register layout (``k_width = 2``): a thread
  holds weight pairs ``(2t, 2t + 1)`` of each group of its rows (t = lane % 4). Each pair is two
  ``ld.shared.b32`` (the pair of C0's and of C1's entry), each addressed by one ``prmt`` (code byte
  and lane offset side by side), and one packed add (one rounding to x's dtype), inline PTX
  (Gluon has no indexed shared load). Lane ``4r + t`` reads copy ``r`` (its row mod 8), so a
  warp's 32 lookups fall on 32 distinct banks whatever the codes.
* Stage 4 (tensor cores): ``wgmma`` m64 x BLOCK_M x k16 per warpgroup (64 rows each), issued
  asynchronously: the next step's stages 2-3 run on the CUDA cores while it computes. The weight
  registers must not change until it is done, hence one WGMMA in flight, waited for at the end of
  each step (a loop-carried register operand of a second one could be moved under it).
* Stage 5 (registers -> HBM): row scale times ``1 / f`` (it factors out of the sum over k), bias, output. Where
  the output tiles do not fill the GPU, K is split over the grid's third axis and the partials meet
  in an fp32 workspace with one arrival counter per tile, as in the MMA decode kernel.

Two forms share these stages (``_mainloop``): :func:`vq_prefill_kernel`, one partition of
``NUM_WARPS`` warps that step together (a CTA barrier per step, then one thread refills the slot),
and :func:`vq_prefill_ws_kernel` (the default on the H200: measured faster), a TMA producer warp and
two consumer warpgroups that release slots through mbarriers and so drift apart: one's
dequantization runs while the other's WGMMA does.

The PTX addresses Triton's ``global_smem`` symbol: the offset of the codebook copies follows
Triton's allocator (``_cb_base``); ``tests/test_gluon_compile.py`` checks that the compiled
kernel stores them where the lookups read (the GPU tests would see another placement as wrong
results). ``kernels.vq_mma_kernel`` computes the same in ``tl`` (the CPU-tested twin).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tilefuse.ops.gluon_compat import mbarrier, thread_barrier, tma_load, warpgroup_mma, warpgroup_mma_wait
from tilefuse.ops.gluon_common import slot_barriers
from tilefuse.ops.vq.kernels_mma import _split_finish, codebook_factor, codebook_peaks, codebook_scan
from tilefuse.ops.vq.ptx import pair_dequant_asm

COPIES = gl.constexpr(8)             # copies of each codebook entry in shared memory
BLOCK_K = gl.constexpr(64)           # inputs per K step: 8 groups
GROUPS = gl.constexpr(8)
CB_ELEMS = gl.constexpr(2 * 256 * 8 * 8)     # the codebook copies, elements of x's dtype (64 KB)
FIRST = gl.constexpr(0)
SECOND = gl.constexpr(1)
PAIR_CON = gl.constexpr("=r,r,r,r,r")        # one packed pair out; 2 code pairs + 2 lane offsets in


@gluon.constexpr_function
def _log2_range(n):
    return range(max(int(n), 1).bit_length() - 1)


@gluon.constexpr_function
def _tile_layout(block_n, num_warps):
    """The A operand (``wgmma`` registers, ``k_width = 2``) as ``[rows, group, j]``: j bit 0, row + 8
    and the group in registers, j bits 1-2 on lanes 0-1, row % 8 on lanes 2-4, warps over 16-row
    tiles, further 16 * num_warps-row tiles in registers (``gl.to_linear_layout`` of the operand,
    with k = 8 * group + j)."""
    block_n, num_warps = int(block_n), int(num_warps)
    reg = [[0, 0, 1], [8, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]] + \
        [[16 * num_warps << i, 0, 0] for i in _log2_range(block_n // (16 * num_warps))]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[0, 0, 2], [0, 0, 4], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
                                      warp_bases=[[16 << i, 0, 0] for i in _log2_range(num_warps)], block_bases=[],
                                      shape=[block_n, 8, 8])


@gluon.constexpr_function
def _codes_layout(block_n, num_warps):
    """The same threads' code pairs ``[rows, group]``, groups first in registers (one 16-byte load
    per row); lanes 0-1 hold copies (the four lanes of a row quad read the same codes)."""
    block_n, num_warps = int(block_n), int(num_warps)
    reg = [[0, 1], [0, 2], [0, 4], [8, 0]] + \
        [[16 * num_warps << i, 0] for i in _log2_range(block_n // (16 * num_warps))]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16 << i, 0] for i in _log2_range(num_warps)], block_bases=[],
                                      shape=[block_n, 8])


@gluon.constexpr_function
def _cb_base(block_m, stages):
    """Byte offset of the codebook copies in ``global_smem``. Triton's allocator places buffers
    that are live together by decreasing size, the earlier allocation first among equals: the
    copies (64 KB, allocated first) go to offset 0 unless the x ring is larger, then after it (the
    code ring is always smaller)."""
    ring = int(stages) * int(block_m) * 64 * 2
    return 0 if ring <= 65536 else ring


_pair_asm = gluon.constexpr_function(pair_dequant_asm)


@gluon.jit
def _dequant_tile(pairs, lane_off, A_OP: gl.constexpr, L3: gl.constexpr, BLOCK_N: gl.constexpr,
                  dtype: gl.constexpr, CB_BASE: gl.constexpr):
    """Code pairs ``[BLOCK_N, 8]`` (int16, memory order) -> the step's weight tile ``[BLOCK_N, 64]``
    in x's dtype, in the A operand's register layout (SMEM codebook copies -> registers).
    ``lane_off``: ``[BLOCK_N, 64]`` int32 in that layout, each element's copy and pair offset."""
    p = gl.convert_layout(pairs, gl.SliceLayout(2, L3)).to(gl.int32)   # a register permutation only
    p = gl.convert_layout(gl.reshape(gl.broadcast(p[:, :, None], gl.zeros([BLOCK_N, GROUPS, 8], gl.int32, L3))[0],
                                     [BLOCK_N, BLOCK_K]), A_OP)      # each pair's codes, no data movement
    if dtype == gl.float16:
        return gl.inline_asm_elementwise(_pair_asm("f16", CB_BASE), PAIR_CON, [p, lane_off], gl.float16, True, 2)
    else:
        return gl.inline_asm_elementwise(_pair_asm("bf16", CB_BASE), PAIR_CON, [p, lane_off], gl.bfloat16, True, 2)


@gluon.jit
def _load_step(x_desc, c_desc, x_ring, c_ring, ready, slot, step, m0, row0):
    """HBM -> SMEM (TMA): K step ``step``'s x box and code box into ring slot ``slot``."""
    bar = ready.index(slot)
    mbarrier.expect(bar, x_desc.block_type.nbytes + c_desc.block_type.nbytes)
    tma_load(x_desc, [m0, step * BLOCK_K], bar, x_ring.index(slot))
    tma_load(c_desc, [row0, step * GROUPS], bar, c_ring.index(slot))


@gluon.jit
def _copy_codebooks(cb_smem, maxima, cb_ptr, NUM_WARPS: gl.constexpr):
    """Stage 0: both codebooks (HBM/L2 -> registers -> SMEM) in x's dtype, 8 copies of each entry,
    interleaved as ``[code, codebook, copy, 8]`` (256 bytes per code: ``pair_dequant_asm``), times
    ``f``; returns ``1 / f``, the factor of the row scales. ``f`` is 1 unless ``C0[a] + C1[b]``
    could overflow x's dtype (fp16 codebooks with entries above 32752): scaling the copies once per
    program keeps the lookup loop as it is, where applying the row scale per weight would add
    instructions to it (``kernels_mma``'s note on it). ``maxima``: shared ``[NUM_WARPS]`` int32."""
    CB: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [NUM_WARPS, 1], [1, 0])
    scan = codebook_scan(cb_ptr, NUM_WARPS)
    ce = gl.arange(0, CB_ELEMS // 8, layout=gl.SliceLayout(1, CB))[:, None]     # (code * 2 + book) * 8 + copy
    cj = gl.arange(0, 8, layout=gl.SliceLayout(0, CB))[None, :]
    entry = ((ce // COPIES) % 2) * 256 + ce // (2 * COPIES)                     # book * 256 + code
    cb_smem.store(gl.load(cb_ptr + entry * 8 + cj).to(cb_smem.dtype))
    codebook_peaks(scan, maxima)
    thread_barrier()
    factor, inverse = codebook_factor(maxima, cb_smem.dtype, NUM_WARPS)
    if factor != 1.0:   # rare: store the copies again, scaled (exact: f is a power of two)
        entries = gl.load(cb_ptr + entry * 8 + cj)
        cb_smem.store((entries * factor.to(entries.dtype)).to(cb_smem.dtype))
        thread_barrier()
    return inverse


@gluon.jit
def _finish(acc, row0, m0, counter, inverse, scales_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, SPLIT_K,
            stride_om, ROWS: gl.constexpr, BLOCK_M: gl.constexpr, ACC: gl.constexpr, SPLIT: gl.constexpr,
            HAS_BIAS: gl.constexpr):
    """Stage 5: scale rows ``row0 ..`` (times ``inverse``, 1 / the codebook copies' factor); split-K
    partials meet in the fp32 workspace (arrival counter ``counter``); bias, output (registers -> HBM)."""
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, ACC))
    toks = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, ACC))
    scale = gl.load(scales_ptr + rows, mask=rows < N, other=0.0).to(gl.float32) * inverse
    _split_finish(acc * scale[:, None], rows, toks, M, N, out_ptr, ws_ptr, cnt_ptr, bias_ptr, stride_om, counter,
                  SPLIT_K, SPLIT, HAS_BIAS)


@gluon.jit
def _mainloop(acc, x_ring, c_ring, ready, empty, x_desc, c_desc, m0, row0, first, steps, ROW: gl.constexpr,
              ROWS: gl.constexpr, NUM_WARPS: gl.constexpr, ACC: gl.constexpr, CB_BASE: gl.constexpr,
              STAGES: gl.constexpr, WS: gl.constexpr):
    """Stages 2-4 over the program's K steps for code-box rows ``ROW .. ROW + ROWS - 1`` (``ROWS = 16 x
    NUM_WARPS``): ``acc`` ([ROWS, BLOCK_M] fp32, layout ACC) += weight tiles x x^T. A slot goes back
    when its WGMMA is done: to the producer partition through ``empty`` (WS), else by a CTA barrier
    and the refill of the step STAGES ahead from here."""
    dtype: gl.constexpr = x_ring.dtype
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    L3: gl.constexpr = _tile_layout(ROWS, NUM_WARPS)
    L_C: gl.constexpr = _codes_layout(ROWS, NUM_WARPS)
    # per-element constant of the A tile: the copy a lane reads (row % 8) and the pair in the entry
    tr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))[:, None, None]
    tj = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, L3)))[None, :], 0)
    offsets = (tr % COPIES) * 16 + (tj // 2) * 4 + gl.zeros([ROWS, GROUPS, 8], gl.int32, L3)
    lane_off = gl.convert_layout(gl.reshape(offsets, [ROWS, BLOCK_K]), A_OP)

    mbarrier.wait(ready.index(0), 0)
    w = _dequant_tile(c_ring.index(0).slice(ROW, ROWS).load(L_C), lane_off, A_OP, L3, ROWS, dtype, CB_BASE)
    for i in range(steps):
        s = i % STAGES
        # stage 4: this step's WGMMA (asynchronous: it reads w's registers and the x slot)
        acc = warpgroup_mma(w, x_ring.index(s).permute((1, 0)), acc, is_async=True)
        # stages 2 + 3 for the next step while it runs: its codes (SMEM -> registers) and weight
        # tile, into other registers (past the last step: stale codes, in bounds, never multiplied)
        nxt = i + 1
        if nxt < steps:
            mbarrier.wait(ready.index(nxt % STAGES), (nxt // STAGES) & 1)
        w_next = _dequant_tile(c_ring.index(nxt % STAGES).slice(ROW, ROWS).load(L_C), lane_off, A_OP, L3, ROWS,
                               dtype, CB_BASE)
        # w's registers and slot s are free once the WGMMA is done
        acc, w = warpgroup_mma_wait(0, deps=[acc, w])
        if WS:
            mbarrier.arrive(empty.index(s))
        else:   # in both warpgroups: then stage 1 refills slot s with the step STAGES ahead
            thread_barrier()
            if i + STAGES < steps:
                _load_step(x_desc, c_desc, x_ring, c_ring, ready, s, first + i + STAGES, m0, row0)
        w = w_next
    return acc


@gluon.jit
def vq_prefill_kernel(
    # x as a TMA descriptor over [M, K] with [BLOCK_M, 64] boxes, the codes over int16 [N, NUM_GROUPS]
    # (low byte codebook 0) with [BLOCK_N, 8] boxes
    x_desc, c_desc, cb_ptr, scales_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    # sizes (NUM_GROUPS and GROUPS_PER_SPLIT multiples of 8), the output's row stride
    M, N, NUM_GROUPS, GROUPS_PER_SPLIT, SPLIT_K, stride_om,
    # meta-parameters: BLOCK_N rows (16 per warp: 64 per warpgroup, or a multiple) x BLOCK_M tokens
    BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
    SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr,
):
    dtype: gl.constexpr = x_desc.dtype
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                  instr_shape=[16, BLOCK_M, 16])
    CB_BASE: gl.constexpr = _cb_base(BLOCK_M, STAGES)

    pid_m = gl.program_id(0)          # token tiles vary fastest: they share the row block's codes in L2
    pid_n = gl.program_id(1)
    row0 = pid_n * BLOCK_N
    m0 = pid_m * BLOCK_M
    first = gl.program_id(2) * (GROUPS_PER_SPLIT // GROUPS)      # this K slice's first step
    steps = (gl.minimum(GROUPS_PER_SPLIT, NUM_GROUPS - first * GROUPS)) // GROUPS

    # shared memory: the codebook copies, then the rings of x boxes and code boxes (allocated in
    # this order; see CB_BASE)
    cb_smem = gl.allocate_shared_memory(dtype, [CB_ELEMS // 8, 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    x_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    c_ring = gl.allocate_shared_memory(gl.int16, [STAGES, BLOCK_N, GROUPS], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    maxima = gl.allocate_shared_memory(gl.int32, [NUM_WARPS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)

    # ---- stage 1 (prologue): the first STAGES steps' x and code boxes (HBM -> SMEM); rows past N
    # and tokens past M arrive as zeros (code 0: in bounds, never stored)
    for i in gl.static_range(STAGES):
        if i < steps:
            _load_step(x_desc, c_desc, x_ring, c_ring, ready, i, first + i, m0, row0)

    inverse = _copy_codebooks(cb_smem, maxima, cb_ptr, NUM_WARPS)     # stage 0

    acc = _mainloop(gl.zeros([BLOCK_N, BLOCK_M], gl.float32, ACC), x_ring, c_ring, ready, ready, x_desc, c_desc, m0,
                    row0, first, steps, 0, BLOCK_N, NUM_WARPS, ACC, CB_BASE, STAGES, False)
    cb_smem._keep_alive()   # the PTX lookups are invisible to the allocator: hold the copies to here
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    _finish(acc, row0, m0, pid_n * gl.num_programs(0) + pid_m, inverse, scales_ptr, bias_ptr, out_ptr, ws_ptr,
            cnt_ptr, M, N, SPLIT_K, stride_om, BLOCK_N, BLOCK_M, ACC, SPLIT, HAS_BIAS)     # one arrival counter per tile


@gluon.jit
def _ws_producer(x_desc, c_desc, x_ring, c_ring, ready, empty, m0, row0, first, steps, STAGES: gl.constexpr):
    """HBM -> SMEM: every step's x and code boxes into the ring, once both consumers released the
    slot (fresh barriers pass the parity-1 wait: the first round finds every slot free)."""
    for i in range(steps):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        _load_step(x_desc, c_desc, x_ring, c_ring, ready, s, first + i, m0, row0)


@gluon.jit
def _ws_consumer(x_ring, c_ring, ready, empty, scales_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, SPLIT_K,
                 stride_om, m0, row0, steps, tile, inverse, W: gl.constexpr, BLOCK_M: gl.constexpr,
                 STAGES: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, CB_BASE: gl.constexpr):
    """Rows ``64 W .. 64 W + 63`` of the tile (one warpgroup): stages 2-5 as in the one-partition
    kernel, releasing each slot to the producer when its WGMMA is done; the two consumers run
    apart, so one's dequantization overlaps the other's WGMMA."""
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    acc = _mainloop(gl.zeros([64, BLOCK_M], gl.float32, ACC), x_ring, c_ring, ready, empty, None, None, m0, row0, 0,
                    steps, W * 64, 64, 4, ACC, CB_BASE, STAGES, True)

    _finish(acc, row0 + W * 64, m0, 2 * tile + W, inverse, scales_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N,
            SPLIT_K, stride_om, 64, BLOCK_M, ACC, SPLIT, HAS_BIAS)     # one arrival counter per tile and consumer


@gluon.jit
def vq_prefill_ws_kernel(
    x_desc, c_desc, cb_ptr, scales_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, NUM_GROUPS, GROUPS_PER_SPLIT, SPLIT_K, stride_om,
    BLOCK_M: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):
    """:func:`vq_prefill_kernel` with its roles split (``gl.warp_specialize``): a TMA producer warp
    and two consumer warpgroups of 64 rows each (``BLOCK_N = 128``; ``num_warps = 4``: the default
    partition is consumer 0, which first copies the codebooks). Same arguments, grid and
    workspace (two arrival counters per output tile, one per consumer)."""
    dtype: gl.constexpr = x_desc.dtype
    CB_BASE: gl.constexpr = _cb_base(BLOCK_M, STAGES)
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    row0 = pid_n * 128
    m0 = pid_m * BLOCK_M
    first = gl.program_id(2) * (GROUPS_PER_SPLIT // GROUPS)
    steps = (gl.minimum(GROUPS_PER_SPLIT, NUM_GROUPS - first * GROUPS)) // GROUPS

    cb_smem = gl.allocate_shared_memory(dtype, [CB_ELEMS // 8, 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    x_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    c_ring = gl.allocate_shared_memory(gl.int16, [STAGES, 128, GROUPS], c_desc.layout)
    ready, empty = slot_barriers(STAGES, 2)      # both consumers read every slot
    maxima = gl.allocate_shared_memory(gl.int32, [4], gl.SwizzledSharedLayout(1, 1, 1, [0]))

    inverse = _copy_codebooks(cb_smem, maxima, cb_ptr, 4)     # stage 0, by the default partition

    tile = pid_n * gl.num_programs(0) + pid_m
    gl.warp_specialize([
        (_ws_consumer, (x_ring, c_ring, ready, empty, scales_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, SPLIT_K,
                        stride_om, m0, row0, steps, tile, inverse, FIRST, BLOCK_M, STAGES, SPLIT, HAS_BIAS, CB_BASE)),
        (_ws_consumer, (x_ring, c_ring, ready, empty, scales_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, SPLIT_K,
                        stride_om, m0, row0, steps, tile, inverse, SECOND, BLOCK_M, STAGES, SPLIT, HAS_BIAS,
                        CB_BASE)),
        (_ws_producer, (x_desc, c_desc, x_ring, c_ring, ready, empty, m0, row0, first, steps, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])
    cb_smem._keep_alive()   # the PTX lookups are invisible to the allocator: hold the copies to here
    # Held too: Triton writes the partitions' captured values to shared memory at warp_specialize
    # without a barrier after the default partition's last reads, so a dead buffer there (maxima is
    # read in _copy_codebooks) may be overwritten while a slower warp still reads it; racecheck
    # reported exactly that overlap (tests/test_racecheck.py).
    maxima._keep_alive()
