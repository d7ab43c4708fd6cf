"""Gluon FP8 SwiGLU kernel for Hopper: a TMA producer warp and two cooperating consumer warpgroups.

Same operation, scales and outputs as ``kernels.swiglu_fp8_kernel`` (see there); what changes is
the schedule. In the ``tl`` kernel each K block's product must leave the tensor core before it is
scaled, and the software pipeline waits for every WGMMA group, so the MMAs of a tile never overlap
its scaling. Here a persistent program per SM runs three partitions (``gl.warp_specialize``):

    producer (1 warp)        TMA: for each of the program's tiles, each pass over 64 of its output
                             columns, each 128-wide K block: the x box [128, 128] and the gate and
                             up rows of those columns [2 x 64, 128] into a ring of STAGES slots
                             (one mbarrier per slot)
    consumer 0 / 1 (4 warps) rows 0-63 / 64-127 of every tile: per K block a fresh WGMMA product
                             (gate and up, 64 columns each), scaled in fp32 and added to the
                             running sums; the slot goes back once both consumers are done with it

The two consumers share nothing but the ring, so one's scaling FMAs run while the other's WGMMAs
do (and the producer keeps STAGES - 1 blocks in flight). Registers per consumer thread: the gate
and up sums of 64 columns (2 x 64 x 64 fp32 / 128 threads = 64) and one product (64); holding
128 columns' sums at once (128 + 64) spilled, hence the passes.

A tile is [128, BLOCK_N] outputs (BLOCK_N = 64 or 128, one or two passes; e4m3 output needs 128,
one scale group: the first pass's SiLU * up result waits in SMEM, fp32, for the group's amax).
The output leaves registers through SMEM, one [64, 64] TMA store per consumer and pass (clipped
at M and I; a bf16 pass's store runs under the next pass's mainloop); e4m3 output also writes
each row's group scale.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tilefuse.ops.gluon_compat import (fence_async_shared, mbarrier, tma, tma_load, tma_store, warpgroup_mma,
                                       warpgroup_mma_wait)
from tilefuse.ops.gluon_common import grouped_tile, slot_barriers

BLOCK_M = gl.constexpr(128)        # rows per tile: 64 per consumer warpgroup (WGMMA's M)
HALF_M = gl.constexpr(64)
BLOCK_K = gl.constexpr(128)        # one scale block of K per step
SUB_N = gl.constexpr(64)           # output columns per WGMMA product (gate and up: 64 each)
FP8_MAX = gl.constexpr(448.0)
WBLOCK = gl.constexpr(128)
LOG2E = gl.constexpr(1.4426950408889634)
FIRST = gl.constexpr(0)
SECOND = gl.constexpr(1)


@gluon.jit
def _producer(x_desc, w_desc, x_ring, w_ring, ready, empty, M, I, K, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr, NUM_SMS: gl.constexpr):
    start = gl.program_id(0)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(I, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    nbytes: gl.constexpr = x_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes
    it = 0
    for tile_id in range(start, num_pid_m * num_pid_n, NUM_SMS):
        pid_m, pid_n = grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        for p in gl.static_range(BLOCK_N // SUB_N):
            col = pid_n * BLOCK_N + p * SUB_N
            for ks in range(k_steps):
                # HBM -> SMEM: slot it % STAGES once both consumers released it (fresh barriers
                # pass the parity-1 wait: the first round finds every slot free).
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, nbytes)
                w = w_ring.index(s)
                tma_load(x_desc, [pid_m * BLOCK_M, ks * BLOCK_K], bar, x_ring.index(s))
                tma_load(w_desc, [col, ks * BLOCK_K], bar, w.slice(0, SUB_N, dim=0))
                tma_load(w_desc, [I + col, ks * BLOCK_K], bar, w.slice(SUB_N, SUB_N, dim=0))
                it += 1


@gluon.jit
def _scaled_block(acc_g, acc_u, x, w, row_scale, ws_g, ws_u, X_GROUPED: gl.constexpr, W_BLOCKED: gl.constexpr,
                  ACC: gl.constexpr):
    """SMEM -> tensor cores -> registers: this K block's product (a fresh fp32 accumulator; w holds
    the 64 gate rows then the 64 up rows), scaled where the scales vary along K, added to the
    running sums."""
    part_g = warpgroup_mma(x, w.slice(0, SUB_N, dim=0).permute((1, 0)),
                           gl.zeros([HALF_M, SUB_N], gl.float32, ACC), use_acc=False, is_async=True)
    part_u = warpgroup_mma(x, w.slice(SUB_N, SUB_N, dim=0).permute((1, 0)),
                           gl.zeros([HALF_M, SUB_N], gl.float32, ACC), use_acc=False, is_async=True)
    part_g, part_u = warpgroup_mma_wait(0, deps=(part_g, part_u))
    if X_GROUPED and W_BLOCKED:
        # one scale per row for the gate and one for the up part: a single FMA per value
        return acc_g + part_g * (row_scale * ws_g)[:, None], acc_u + part_u * (row_scale * ws_u)[:, None]
    if X_GROUPED:
        return acc_g + part_g * row_scale[:, None], acc_u + part_u * row_scale[:, None]
    if W_BLOCKED:
        return acc_g + part_g * ws_g, acc_u + part_u * ws_u
    return acc_g + part_g, acc_u + part_u


@gluon.jit
def _finish_half(acc_g, acc_u, rows, cols, M, I, xs_ptr, ws_ptr, stride_xs_m, stride_ws_n, X_GROUPED: gl.constexpr,
                 W_BLOCKED: gl.constexpr):
    """registers: the scales constant along K (per token, per weight row) applied to the finished
    sums of 64 output columns, then SiLU(gate) * up in fp32."""
    if not X_GROUPED:
        row_scale = gl.load(xs_ptr + gl.minimum(rows, M - 1) * stride_xs_m)
        acc_g = acc_g * row_scale[:, None]
        acc_u = acc_u * row_scale[:, None]
    if not W_BLOCKED:
        c = gl.minimum(cols, I - 1)
        acc_g = acc_g * gl.load(ws_ptr + c * stride_ws_n)[None, :]
        acc_u = acc_u * gl.load(ws_ptr + (I + c) * stride_ws_n)[None, :]
    return acc_g / (1.0 + gl.exp2(-acc_g * LOG2E)) * acc_u


@gluon.jit
def _consumer(x_ring, w_ring, ready, empty, out_smem, h_smem, out_desc, xs_ptr, ws_ptr, os_ptr, M, I, K, stride_xs_m,
              stride_xs_k, stride_ws_n, stride_ws_k, stride_os_m, W: gl.constexpr, X_GROUPED: gl.constexpr,
              W_BLOCKED: gl.constexpr, QUANT_OUT: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr, NUM_SMS: gl.constexpr):
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, SUB_N, 32])
    ROWS: gl.constexpr = gl.SliceLayout(1, ACC)
    COLS: gl.constexpr = gl.SliceLayout(0, ACC)
    start = gl.program_id(0)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(I, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    zero = gl.zeros([HALF_M, SUB_N], gl.float32, ACC)
    it = 0
    for tile_id in range(start, num_pid_m * num_pid_n, NUM_SMS):
        pid_m, pid_n = grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        rows = pid_m * BLOCK_M + W * HALF_M + gl.arange(0, HALF_M, layout=ROWS)
        xs_rows = xs_ptr + gl.minimum(rows, M - 1) * stride_xs_m
        ws_g_row = ws_ptr + (pid_n * BLOCK_N // WBLOCK) * stride_ws_n
        ws_u_row = ws_ptr + ((I + pid_n * BLOCK_N) // WBLOCK) * stride_ws_n
        amax = gl.zeros([HALF_M], gl.float32, ROWS)
        for p in gl.static_range(BLOCK_N // SUB_N):
            acc_g = zero
            acc_u = zero
            # HBM -> registers: the scales of K block 0; in the loop, those of the next block are
            # loaded a block ahead, so their latency hides under a whole block's WGMMAs.
            row_scale_next = gl.load(xs_rows) if X_GROUPED else None
            ws_g_next = gl.load(ws_g_row) if W_BLOCKED else None
            ws_u_next = gl.load(ws_u_row) if W_BLOCKED else None
            for ks in range(k_steps):
                row_scale = row_scale_next
                ws_g = ws_g_next
                ws_u = ws_u_next
                nxt = gl.minimum(ks + 1, k_steps - 1)        # the last block reloads its own
                if X_GROUPED:
                    row_scale_next = gl.load(xs_rows + nxt * stride_xs_k)
                if W_BLOCKED:
                    ws_g_next = gl.load(ws_g_row + nxt * stride_ws_k)
                    ws_u_next = gl.load(ws_u_row + nxt * stride_ws_k)
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                x = x_ring.index(s).slice(W * HALF_M, HALF_M, dim=0)       # this consumer's 64 rows
                acc_g, acc_u = _scaled_block(acc_g, acc_u, x, w_ring.index(s), row_scale, ws_g, ws_u, X_GROUPED,
                                             W_BLOCKED, ACC)
                mbarrier.arrive(empty.index(s))
                it += 1

            # Epilogue of the pass: registers -> SMEM -> HBM, this consumer's 64 rows x 64 columns
            # (one [64, 64] buffer and TMA store per pass, clipped at M and I).
            cols = pid_n * BLOCK_N + p * SUB_N + gl.arange(0, SUB_N, layout=COLS)
            h = _finish_half(acc_g, acc_u, rows, cols, M, I, xs_ptr, ws_ptr, stride_xs_m, stride_ws_n, X_GROUPED,
                             W_BLOCKED)
            row0 = pid_m * BLOCK_M + W * HALF_M
            if QUANT_OUT:
                # One e4m3 scale per row and 128-column group: amax / 448 (1 for an all-zero
                # group); values clamped to +-448 (no NaN from a rounding overshoot).
                amax = gl.maximum(amax, gl.max(gl.abs(h), axis=1))
                if p == 0:
                    h_smem.store(h)         # waits, fp32, for the second pass's amax
                else:
                    scale = gl.where(amax > 0, amax / FP8_MAX, 1.0)
                    tma.store_wait(0)       # the previous tile's stores have left the buffers
                    for q in gl.static_range(2):
                        hq = h_smem.load(ACC) if q == 0 else h
                        hq = gl.minimum(gl.maximum(hq / scale[:, None], -FP8_MAX), FP8_MAX)
                        out_smem.index(W * 2 + q).store(hq.to(out_desc.dtype))
                    fence_async_shared()
                    for q in gl.static_range(2):
                        tma_store(out_desc, [row0, pid_n * BLOCK_N + q * SUB_N], out_smem.index(W * 2 + q))
                    gl.store(os_ptr + rows * stride_os_m + pid_n, scale, mask=rows < M)
            else:
                # this pass's buffer is free once at most the other passes' stores are pending
                tma.store_wait(BLOCK_N // SUB_N - 1)
                buf = out_smem.index(W * (BLOCK_N // SUB_N) + p)
                buf.store(h.to(out_desc.dtype))
                fence_async_shared()
                tma_store(out_desc, [row0, pid_n * BLOCK_N + p * SUB_N], buf)
    tma.store_wait(0)


@gluon.jit
def swiglu_fp8_ws_kernel(
    x_desc, w_desc, out_desc, xs_ptr, ws_ptr, os_ptr,
    M, I, K,
    stride_xs_m, stride_xs_k, stride_ws_n, stride_ws_k, stride_os_m,
    X_GROUPED: gl.constexpr, W_BLOCKED: gl.constexpr, QUANT_OUT: gl.constexpr,
    BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_SMS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Persistent warp-specialized FP8 SwiGLU over [128, BLOCK_N] output tiles.

    x_desc: x ``[M, K]`` e4m3 in ``[128, 128]`` boxes; w_desc: the merged weight ``[2I, K]`` e4m3 in
    ``[64, 128]`` boxes (gate rows at ``n``, up rows at ``I + n``); out_desc: out ``[M, I]`` in
    ``[64, 64]`` boxes (bf16 / fp16 / fp32, or e4m3 with QUANT_OUT, BLOCK_N = 128). Scales
    as ``kernels.swiglu_fp8_kernel`` takes them. ``num_warps = 4``: the default partition is
    consumer 0. Grid: ``(min(NUM_SMS, tiles),)``.
    Shared memory: STAGES x 32 KB of ring, [64, 64] output buffers (one per consumer and pass)
    and (QUANT_OUT) two [64, 64] fp32 buffers for the first pass's result.
    """
    x_ring = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    w_ring = gl.allocate_shared_memory(w_desc.dtype, [STAGES, 2 * SUB_N, BLOCK_K], w_desc.layout)
    # [64, 64] output buffers: consumer W's for pass p at index W * passes + p
    out_smem = gl.allocate_shared_memory(out_desc.dtype, [2 * (BLOCK_N // SUB_N), HALF_M, SUB_N], out_desc.layout)
    H_SMEM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    h_smem = gl.allocate_shared_memory(gl.float32, [2, HALF_M, SUB_N] if QUANT_OUT else [2, 1, 1], H_SMEM)
    ready, empty = slot_barriers(STAGES, 2)      # both consumers read every slot

    # (argument tuples written out in the call: a tuple held in a variable loses its constexprs)
    gl.warp_specialize([
        (_consumer, (x_ring, w_ring, ready, empty, out_smem, h_smem.index(0), out_desc, xs_ptr, ws_ptr,
                     os_ptr, M, I, K, stride_xs_m, stride_xs_k, stride_ws_n, stride_ws_k, stride_os_m, FIRST,
                     X_GROUPED, W_BLOCKED, QUANT_OUT, BLOCK_N, GROUP_M, STAGES, NUM_SMS)),
        (_consumer, (x_ring, w_ring, ready, empty, out_smem, h_smem.index(1), out_desc, xs_ptr, ws_ptr,
                     os_ptr, M, I, K, stride_xs_m, stride_xs_k, stride_ws_n, stride_ws_k, stride_os_m, SECOND,
                     X_GROUPED, W_BLOCKED, QUANT_OUT, BLOCK_N, GROUP_M, STAGES, NUM_SMS)),
        (_producer, (x_desc, w_desc, x_ring, w_ring, ready, empty, M, I, K, BLOCK_N, GROUP_M, STAGES, NUM_SMS)),
    ], [4, 1], [240, 24])
