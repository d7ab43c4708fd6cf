"""Gluon large-M SwiGLU kernel for Hopper: the paper's ping-pong schedule (Kernel-1).

A persistent program per SM runs three partitions over its output tiles (tile ``start``,
``start + NUM_SMS``, ... in grouped order):

    producer (1 warp)        TMA: the K steps of every tile, in order, into a ring of STAGES
                             shared-memory slots (x [BLOCK_M, BLOCK_K] + gate/up weight rows
                             [2 BLOCK_N, BLOCK_K]); one mbarrier per slot flips when its bytes land
    consumer 0 (4 warps)     the program's even tiles: WGMMA over the ring into two fp32
                             accumulators (gate, up), then the epilogue
    consumer 1 (4 warps)     the odd tiles, the same way

The two consumer warpgroups take turns: while one runs its epilogue (bias, SiLU * mul in fp32,
one rounding, registers -> SMEM -> TMA store), the other's WGMMAs keep the tensor cores busy on
the next tile, so the epilogue leaves the critical path (the ``tl`` kernel of ``kernels.py``
runs it between tiles). The ring is shared and filled in tile order; the mainloops run in tile
order too: a pair of ``turn`` mbarriers passes the ring from one consumer to the other once a
mainloop has issued its last WGMMAs. That order keeps the ring's parity waits exact: a consumer
never waits for a slot more than one fill ahead of the barrier's phase (running the two
mainloops independently, the second consumer's first wait would match an earlier fill of the
same parity).

Weight rows of an output tile ``[off_n, off_n + BLOCK_N)``: the gate rows then the up rows, each
copied by TMA into its half of the slot's ``[2 BLOCK_N, BLOCK_K]`` buffer in ``CHUNK``-row pieces:

* merged (``[2I, H]``, gate rows then up rows): one piece each, rows ``off_n`` and ``I + off_n``;
  gate rows past I read the first up rows (those output columns are past I and never stored),
  up rows past 2I are zero-filled by TMA;
* packed (:func:`tilefuse.pack_gate_up`, 64-row gate/up blocks): ``BLOCK_N / PACK`` pieces each,
  the gate block of output block b at row ``2 off_n + 2 PACK b``, its up block ``PACK`` below.

Out-of-range rows of x and the K tail are zero-filled by TMA; the TMA store clips at M and I.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tilefuse.ops.gluon_compat import (fence_async_shared, mbarrier, tma, tma_load, tma_store, warpgroup_mma,
                                       warpgroup_mma_wait)
from tilefuse.ops.gluon_common import grouped_tile, slot_barriers

LOG2E = gl.constexpr(1.4426950408889634)
FIRST = gl.constexpr(0)            # the consumers' indices (constexpr arguments)
SECOND = gl.constexpr(1)


@gluon.jit
def _producer(x_desc, w_desc, x_ring, w_ring, ready, empty, M, I, H, PACKED: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, CHUNK: gl.constexpr,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_SMS: gl.constexpr):
    start = gl.program_id(0)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(I, BLOCK_N)
    k_steps = gl.cdiv(H, BLOCK_K)
    nbytes: gl.constexpr = x_desc.block_type.nbytes + 2 * (BLOCK_N // CHUNK) * w_desc.block_type.nbytes
    it = 0
    for tile_id in range(start, num_pid_m * num_pid_n, NUM_SMS):
        pid_m, pid_n = grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        for ks in range(k_steps):
            # HBM -> SMEM: slot it % STAGES, once its last reader released it (a fresh barrier
            # passes the parity-1 wait, so the first round finds every slot free).
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            k = ks * BLOCK_K
            tma_load(x_desc, [off_m, k], bar, x_ring.index(s))
            w = w_ring.index(s)
            for c in gl.static_range(BLOCK_N // CHUNK):
                if PACKED:
                    gate_row = 2 * off_n + 2 * CHUNK * c
                    up_row = gate_row + CHUNK
                else:
                    gate_row = off_n
                    up_row = I + off_n
                tma_load(w_desc, [gate_row, k], bar, w.slice(c * CHUNK, CHUNK, dim=0))
                tma_load(w_desc, [up_row, k], bar, w.slice(BLOCK_N + c * CHUNK, CHUNK, dim=0))
            it += 1


@gluon.jit
def _consumer(x_ring, w_ring, ready, empty, turn, out_smem, out_desc, bias_ptr, M, I, H, ROLE: gl.constexpr,
              HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_SMS: gl.constexpr):
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    start = gl.program_id(0)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(I, BLOCK_N)
    k_steps = gl.cdiv(H, BLOCK_K)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, ACC)
    # This warpgroup's tiles: the program's local tiles ROLE, ROLE + 2, ...; local tile t's K steps
    # are ring positions t * k_steps .. t * k_steps + k_steps - 1.
    # Its j-th mainloop waits for the other's (consumer 0: a fresh barrier passes the parity-1
    # wait, so its first tile goes at once).
    t = ROLE
    j = 0
    for tile_id in range(start + ROLE * NUM_SMS, num_pid_m * num_pid_n, 2 * NUM_SMS):
        it0 = t * k_steps
        acc_g = zero
        acc_u = zero
        mbarrier.wait(turn.index(ROLE), (j & 1) ^ (1 - ROLE))
        for ks in range(k_steps):
            it = it0 + ks
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            # SMEM -> tensor cores: [BM, BK] x [BK, BN] for the gate and for the up half of the
            # slot; both issued asynchronously, then this step's pair left in flight while the
            # previous step's pair retires and its slot goes back to the producer.
            x = x_ring.index(s)
            w = w_ring.index(s)
            acc_g = warpgroup_mma(x, w.slice(0, BLOCK_N, dim=0).permute((1, 0)), acc_g, use_acc=ks > 0,
                                  is_async=True)
            acc_u = warpgroup_mma(x, w.slice(BLOCK_N, BLOCK_N, dim=0).permute((1, 0)), acc_u, use_acc=ks > 0,
                                  is_async=True)
            acc_g, acc_u = warpgroup_mma_wait(2, deps=(acc_g, acc_u))
            if ks > 0:
                mbarrier.arrive(empty.index((it - 1) % STAGES))
        # The ring passes to the other consumer once this tile's last WGMMAs are issued: its first
        # ones queue behind them on the tensor cores (its slots were filled after these).
        mbarrier.arrive(turn.index(1 - ROLE))
        acc_g, acc_u = warpgroup_mma_wait(0, deps=(acc_g, acc_u))
        mbarrier.arrive(empty.index((it0 + k_steps - 1) % STAGES))

        # Epilogue (registers -> SMEM -> HBM), overlapped with the other warpgroup's mainloop:
        # bias (merged order: gate bias at n, up bias at I + n), SiLU * mul in fp32, one rounding.
        pid_m, pid_n = grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        if HAS_BIAS:
            cols = gl.minimum(pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, ACC)), I - 1)
            acc_g = acc_g + gl.load(bias_ptr + cols).to(gl.float32)[None, :]
            acc_u = acc_u + gl.load(bias_ptr + I + cols).to(gl.float32)[None, :]
        h = acc_g / (1.0 + gl.exp2(-acc_g * LOG2E)) * acc_u
        tma.store_wait(0)                 # this warpgroup's previous tile has left out_smem
        out_smem.store(h.to(out_desc.dtype))
        fence_async_shared()
        tma_store(out_desc, [pid_m * BLOCK_M, pid_n * BLOCK_N], out_smem)
        t += 2
        j += 1
    tma.store_wait(0)


@gluon.jit
def swiglu_pingpong_kernel(
    x_desc, w_desc, out_desc, bias_ptr,
    M, I, H,
    HAS_BIAS: gl.constexpr, PACKED: gl.constexpr, CHUNK: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_SMS: gl.constexpr, num_warps: gl.constexpr,
):
    """Persistent ping-pong SwiGLU: ``out[M, I] = silu(x W_gate^T + b_g) * (x W_up^T + b_u)``.

    x_desc: x ``[M, H]`` in ``[BLOCK_M, BLOCK_K]`` boxes; w_desc: the weight ``[2I, H]`` in
    ``[CHUNK, BLOCK_K]`` boxes (CHUNK = BLOCK_N merged, PACK packed); out_desc: out ``[M, I]`` in
    ``[BLOCK_M, BLOCK_N]`` boxes; bf16 or fp16 throughout, fp32 accumulation. ``num_warps = 4``:
    the default partition is consumer 0; consumer 1 (4 warps) and the producer (1 warp) are workers.
    Grid: ``(min(NUM_SMS, tiles),)``.

    Shared memory: STAGES x (BLOCK_M + 2 BLOCK_N) x BLOCK_K x 2 bytes of ring plus two
    [BLOCK_M, BLOCK_N] output buffers, e.g. 4 x 32 KB + 2 x 16 KB = 160 KB at 128 x 64 x 64.
    Registers: each consumer holds 2 x BLOCK_M x BLOCK_N fp32 (128 per thread at 128 x 64).
    """
    dtype: gl.constexpr = x_desc.dtype
    x_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    w_ring = gl.allocate_shared_memory(dtype, [STAGES, 2 * BLOCK_N, BLOCK_K], w_desc.layout)
    out_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], out_desc.layout)
    ready, empty = slot_barriers(STAGES, 1)      # each slot has one reader: the consumer of its tile
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):                 # turn[c]: consumer c's mainloop may start
        mbarrier.init(turn.index(i), count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_consumer, (x_ring, w_ring, ready, empty, turn, out_smem.index(0), out_desc, bias_ptr, M, I, H, FIRST,
                     HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, NUM_SMS)),
        (_consumer, (x_ring, w_ring, ready, empty, turn, out_smem.index(1), out_desc, bias_ptr, M, I, H, SECOND,
                     HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, NUM_SMS)),
        (_producer, (x_desc, w_desc, x_ring, w_ring, ready, empty, M, I, H, PACKED, BLOCK_M, BLOCK_N, BLOCK_K,
                     CHUNK, GROUP_M, STAGES, NUM_SMS)),
    ], [4, 1], [232, 40])
