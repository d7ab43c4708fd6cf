"""Triton kernels of the fused SwiGLU gate/up projection: ``h = silu(x Wg^T + bg) * (x Wu^T + bu)``.

Both kernels keep the gate and the up accumulators of one output tile in registers (fp32), apply
SiLU * mul there and round once to the output dtype, so the ``[M, 2I]`` intermediate never reaches
HBM (paper 1). They differ in how they feed the tensor cores:

* :func:`swiglu_small_m_kernel` (the paper's Kernel-2, "interleaved"): one program per output tile
  and K slice, pointer loads, optional split-K with an in-kernel fix-up (the last K slice of a tile
  to finish sums the fp32 partials and runs the epilogue), so even M = 1 fills all 132 SMs.
  Decode-sized M is memory-bound: what matters is bytes in flight, not MMA shape.
* :func:`swiglu_large_m_kernel` (Kernel-1, "ping-pong"): persistent grid of one program per SM,
  host-side TMA descriptors, grouped tile order for L2 reuse, the loop flagged for Triton's warp
  specialization (on sm_90 Triton 3.6 software-pipelines it instead), and an optional stream-K
  tail: the tiles of the last, partial wave are shared out by K steps over all programs, so a
  shape whose tile count is just above a multiple of the SM count does not run a near-empty wave.

Weight layouts (``w: [2I, H]`` row-major, K = H contiguous):

* merged (vLLM): gate rows ``[0, I)``, up rows ``[I, 2I)``. The small-M kernel reads gate rows ``n``
  and up rows ``I + n`` through two pointer sets (two dots); the large-M kernel views the weight as
  ``[2, I, H]`` and loads one 3-D TMA box ``[2, BLOCK_N, BLOCK_K]`` holding both, so it runs one
  dot of N = 2 BLOCK_N like the packed layout (no repacking needed).
* packed (:func:`tilefuse.pack_gate_up`): blocks of ``2 * PACK`` rows, ``PACK`` gate rows then the
  matching ``PACK`` up rows; the large-M kernel loads one ``[2 BLOCK_N, BLOCK_K]`` box holding both
  and runs a single dot of N = 2 BLOCK_N, then splits the accumulator's columns in the epilogue.
"""

import triton
import triton.language as tl

from tilefuse.ops.tl_common import arrive, grouped_tile, load_gate_up_step, split_k_gate_up, split_k_tile, store_h


@triton.jit
def _silu_mul(gate, up):
    # fp32 in, fp32 out: silu(g) * u = g * sigmoid(g) * u, on the accumulator, before any rounding.
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _packed_row(offs_n, PACK: tl.constexpr):
    # Row of gate column n in the packed layout (the matching up row is PACK further down).
    return (offs_n // PACK) * (2 * PACK) + offs_n % PACK


@triton.jit
def _gate_up_rows(cols, I, PACKED: tl.constexpr, PACK: tl.constexpr):
    # (gate row, up row) of output columns `cols` in the weight (or in the [M, 2I] GEMM output).
    if PACKED:
        rows_g = _packed_row(cols, PACK)
        rows_u = rows_g + PACK
    else:
        rows_g = cols
        rows_u = cols + I
    return rows_g, rows_u


@triton.jit
def swiglu_small_m_kernel(
    # pointers
    x_ptr, w_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr,
    # sizes
    M, I, H,
    # strides (the last dimension of every tensor has unit stride)
    stride_xm, stride_wn, stride_om,
    # 0.0, passed at run time so PROMOTE's fresh accumulators are not folded back (see below)
    acc_zero,
    # meta-parameters
    HAS_BIAS: tl.constexpr, PACKED: tl.constexpr, PACK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, PROMOTE: tl.constexpr, MASK_ROWS: tl.constexpr,
):
    """One program = one [BLOCK_M, BLOCK_N] output tile over one K slice (of SPLIT_K).

    Grid: (cdiv(I, BLOCK_N), cdiv(M, BLOCK_M), SPLIT_K); n fastest so neighbouring programs share
    the x rows in L2. Tile shape: M <= 256 means few x rows and a weight stream that dominates the
    bytes, so BLOCK_N is small (16-64) to make enough programs and BLOCK_K large (128-256) so each
    load moves wide 16-byte vectors and several are in flight per SM.
    """
    # This program's tile and K slice, in whole BLOCK_K steps; out-of-range weight rows clamped to
    # the last valid one (no masks on the weight stream), their results dropped by the store mask.
    # x rows past M (MASK_ROWS: M not a multiple of BLOCK_M) are masked, not clamped: many lanes
    # loading one clamped row measured up to 1.6x slower on the H200 (M = 33 in 64-row tiles).
    pid_m, pid_n, pid_k, offs_m, offs_n, rows_x, cols, k_begin, k_end = split_k_tile(
        M, I, H, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)
    if MASK_ROWS:
        rows_x = offs_m
    rows_g, rows_u = _gate_up_rows(cols, I, PACKED, PACK)

    offs_k = k_begin * BLOCK_K + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows_x[:, None] * stride_xm + offs_k[None, :]
    wg_ptrs = w_ptr + rows_g[:, None] * stride_wn + offs_k[None, :]
    wu_ptrs = w_ptr + rows_u[:, None] * stride_wn + offs_k[None, :]

    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Main loop: HBM -> registers (software-pipelined through SMEM by num_stages); x [BM, BK] is
    # shared by both dots, the gate and up weight tiles [BN, BK] stream once each.
    for ks in range(k_begin, k_end):
        x, wg, wu = load_gate_up_step(x_ptrs, wg_ptrs, wu_ptrs, ks, H, BLOCK_K, EVEN_K, offs_m < M, MASK_ROWS)
        if PROMOTE:
            # Each K step's product starts from zero in the tensor core and is added to the fp32
            # total by ordinary (round-to-nearest) adds, in case the tensor core's own fp32
            # accumulation is what puts ~0.1 % of bf16 outputs beyond 1 ulp at H = 8192. The zero
            # is a run-time value: with a constant zero Triton folds `acc + dot(a, b, 0)` back into
            # `dot(a, b, acc)` (seen in the TTIR). Off by default (docs/swiglu.md: accuracy, cost).
            acc_g += tl.dot(x, tl.trans(wg), tl.full((BLOCK_M, BLOCK_N), acc_zero, tl.float32))
            acc_u += tl.dot(x, tl.trans(wu), tl.full((BLOCK_M, BLOCK_N), acc_zero, tl.float32))
        else:
            acc_g = tl.dot(x, tl.trans(wg), acc_g)
            acc_u = tl.dot(x, tl.trans(wu), acc_u)
        x_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K

    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < I)
    if SPLIT_K > 1:
        # Split-K fix-up: the last K slice of the tile to arrive sums the partials and finishes it.
        last, acc_g, acc_u = split_k_gate_up(acc_g, acc_u, ws_ptr, lock_ptr, pid_m * tl.num_programs(0) + pid_n,
                                             pid_k, M * I, offs_m[:, None] * I + offs_n[None, :], out_mask, SPLIT_K)
        if last:
            _small_m_epilogue(acc_g, acc_u, bias_ptr, out_ptr, offs_m, offs_n, cols, I, stride_om,
                              out_mask, HAS_BIAS)
    else:
        _small_m_epilogue(acc_g, acc_u, bias_ptr, out_ptr, offs_m, offs_n, cols, I, stride_om,
                          out_mask, HAS_BIAS)


@triton.jit
def _small_m_epilogue(acc_g, acc_u, bias_ptr, out_ptr, offs_m, offs_n, cols, I, stride_om, out_mask,
                      HAS_BIAS: tl.constexpr):
    # Registers -> HBM: bias (merged order: gate bias at n, up bias at I + n), SiLU * mul in fp32,
    # one rounding to the output dtype, a masked store of the [BM, BN] tile.
    if HAS_BIAS:
        acc_g += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        acc_u += tl.load(bias_ptr + I + cols).to(tl.float32)[None, :]
    h = _silu_mul(acc_g, acc_u)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _gate_up_mma(x_desc, w_desc, off_m, off_n, k_lo, k_hi, acc_zero,
                 PACKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PROMOTE: tl.constexpr):
    # K steps [k_lo, k_hi) of one tile: HBM -TMA-> SMEM (multi-stage ring) -WGMMA-> fp32 registers,
    # one dot of N = 2 BLOCK_N per K step (two dots in one loop made ptxas serialize the WGMMAs).
    # TMA zero-fills out-of-range rows and the K tail, so there are no masks here.
    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    for ks in range(k_lo, k_hi):
        x = x_desc.load([off_m, ks * BLOCK_K])
        if PACKED:
            # w_desc: [2I, H]; rows [2 off_n, 2 off_n + 2 BLOCK_N) = BLOCK_N / PACK packed blocks.
            w = w_desc.load([2 * off_n, ks * BLOCK_K])
        else:
            # w_desc: the merged weight viewed as [2, I, H]; the box [2, BLOCK_N, BLOCK_K] holds
            # gate rows off_n.. and up rows I + off_n.. (each plane zero-filled past I).
            w = w_desc.load([0, off_n, ks * BLOCK_K]).reshape(2 * BLOCK_N, BLOCK_K)
        if PROMOTE:  # see the small-M kernel; measured 1.4-2.1x slower here (docs/swiglu.md)
            acc += tl.dot(x, w.T, tl.full((BLOCK_M, 2 * BLOCK_N), acc_zero, tl.float32))
        else:
            acc = tl.dot(x, w.T, acc)
    return acc


@triton.jit
def _split_gate_up(acc, PACKED: tl.constexpr, PACK: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    # Columns come as [block, gate|up, cols]: move gate|up last and split it off.
    if PACKED:
        acc = acc.reshape(BLOCK_M, BLOCK_N // PACK, 2, PACK).permute(0, 1, 3, 2)
    else:
        acc = acc.reshape(BLOCK_M, 1, 2, BLOCK_N).permute(0, 1, 3, 2)
    gate, up = tl.split(acc)
    return gate.reshape(BLOCK_M, BLOCK_N), up.reshape(BLOCK_M, BLOCK_N)


@triton.jit
def _large_m_epilogue(gate, up, bias_ptr, out_desc, pid_m, pid_n, I, HAS_BIAS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Registers -> SMEM -TMA-> HBM: bias, SiLU * mul in fp32, one rounding, a TMA store (clipped
    # at M and I by the descriptor).
    if HAS_BIAS:
        cols = tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), I - 1)
        gate += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        up += tl.load(bias_ptr + I + cols).to(tl.float32)[None, :]
    h = _silu_mul(gate, up)
    out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], h.to(out_desc.dtype))


@triton.jit(do_not_specialize=["sk_tiles", "sk_iters"])  # one binary per config, whatever the split
def swiglu_large_m_kernel(
    # TMA descriptors (host-side) and plain pointers
    x_desc, w_desc, out_desc, bias_ptr, ws_ptr, lock_ptr,
    # sizes
    M, I, H,
    # stream-K region: the last sk_tiles tiles, sk_iters K steps per program (see below)
    sk_tiles, sk_iters,
    # 0.0 at run time (PROMOTE, see the small-M kernel)
    acc_zero,
    # meta-parameters
    HAS_BIAS: tl.constexpr, PACKED: tl.constexpr, PACK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    STREAM_K: tl.constexpr, PROMOTE: tl.constexpr,
):
    """Persistent: program p handles tiles p, p + NUM_SMS, ... in grouped order, then (STREAM_K) an
    equal share of the K steps of the last ``sk_tiles`` tiles.

    Tile shape: BLOCK_M x BLOCK_N output columns means a BLOCK_M x 2 BLOCK_N GEMM tile (gate and
    up), e.g. 128 x 256 for BLOCK_N = 128: the shape CUTLASS's ping-pong kernels use on Hopper, big
    enough that WGMMA is fed from SMEM at full rate while TMA streams the next K step.
    x_desc boxes [BLOCK_M, BLOCK_K]; w_desc boxes [2, BLOCK_N, BLOCK_K] over the merged weight
    viewed as [2, I, H], or [2 BLOCK_N, BLOCK_K] over the packed [2I, H]; out_desc boxes
    [BLOCK_M, BLOCK_N].
    """
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(I, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_steps = tl.cdiv(H, BLOCK_K)
    dp_tiles = num_tiles - sk_tiles  # whole waves: NUM_SMS divides dp_tiles when STREAM_K
    tile_epi = start - NUM_SMS

    # Data-parallel part: one whole tile per iteration.
    for tile_id in tl.range(start, dp_tiles, NUM_SMS, flatten=True, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        acc = _gate_up_mma(x_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, 0, k_steps, acc_zero,
                           PACKED, BLOCK_M, BLOCK_N, BLOCK_K, PROMOTE)
        gate, up = _split_gate_up(acc, PACKED, PACK, BLOCK_M, BLOCK_N)
        # Epilogue: recompute the tile from its own counter, as the flattened, warp-specialized
        # loop may run it while the next tile's loads are issued.
        tile_epi += NUM_SMS
        pid_m, pid_n = grouped_tile(tile_epi, num_pid_m, num_pid_n, GROUP_M)
        _large_m_epilogue(gate, up, bias_ptr, out_desc, pid_m, pid_n, I, HAS_BIAS, BLOCK_M, BLOCK_N)

    if STREAM_K:
        # Stream-K part (the tail wave that would leave SMs idle): the sk_tiles * k_steps K steps
        # of the last tiles are dealt out in equal contiguous runs of sk_iters, one run per
        # program, so a run covers the end of one tile, whole tiles, and the start of another.
        # A partial tile parks its fp32 gate/up partials in ws[program, first|last run piece]
        # and adds its K steps to the tile's ticket; the piece that completes the count sums all
        # pieces (programs q with runs overlapping the tile), runs the epilogue and re-arms the
        # ticket (0 between calls and CUDA-graph replays). Cost: each piece is a BLOCK_M x
        # 2 BLOCK_N fp32 tile written and read back, 2 BLOCK_M / K of the tile's weight bytes per
        # pass: cheap for long K (7B+), not for the small models (measured, docs/swiglu.md).
        it_lo = start * sk_iters
        it_hi = tl.minimum(it_lo + sk_iters, sk_tiles * k_steps)
        tile_elems = BLOCK_M * BLOCK_N
        offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        first_t = it_lo // k_steps
        for t in range(first_t, tl.cdiv(it_hi, k_steps)):
            k_lo = tl.maximum(it_lo - t * k_steps, 0)
            k_hi = tl.minimum(it_hi - t * k_steps, k_steps)
            pid_m, pid_n = grouped_tile(dp_tiles + t, num_pid_m, num_pid_n, GROUP_M)
            acc = _gate_up_mma(x_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, k_lo, k_hi, acc_zero,
                               PACKED, BLOCK_M, BLOCK_N, BLOCK_K, PROMOTE)
            gate, up = _split_gate_up(acc, PACKED, PACK, BLOCK_M, BLOCK_N)
            done = k_hi - k_lo == k_steps
            if k_hi - k_lo < k_steps:
                piece = ws_ptr + (2 * start + (t != first_t).to(tl.int32)) * 2 * tile_elems
                tl.store(piece + offs, gate)
                tl.store(piece + tile_elems + offs, up)
                done = arrive(lock_ptr + t, k_hi - k_lo, k_steps)
                if done:
                    # Sum the pieces in program order (this one's own re-read from L2), so the
                    # result does not depend on which piece finished last: bit-reproducible.
                    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    for q in range(t * k_steps // sk_iters, tl.cdiv((t + 1) * k_steps, sk_iters)):
                        other = ws_ptr + (2 * q + (q * sk_iters // k_steps != t).to(tl.int32)) * 2 * tile_elems
                        gate += tl.load(other + offs, cache_modifier=".cg")
                        up += tl.load(other + tile_elems + offs, cache_modifier=".cg")
                    tl.atomic_xchg(lock_ptr + t, 0)
            if done:
                _large_m_epilogue(gate, up, bias_ptr, out_desc, pid_m, pid_n, I, HAS_BIAS,
                                  BLOCK_M, BLOCK_N)


@triton.jit
def silu_mul_kernel(
    # pointers
    y_ptr, bias_ptr, out_ptr, os_ptr,
    # sizes
    M, I,
    # strides (unit last stride)
    stride_ym, stride_om, stride_os_m,
    # meta-parameters
    HAS_BIAS: tl.constexpr, PACKED: tl.constexpr, PACK: tl.constexpr, QUANT_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The second half of the unfused paths (the baselines the dispatch keeps as candidates):
    ``out[m, n] = silu(y[m, gate n]) * y[m, up n]`` over a GEMM's ``y: [M, 2I]`` (merged: gate n
    at column n, up at I + n; packed: at ``_packed_row(n)`` and PACK further), one
    ``[BLOCK_M, BLOCK_N]`` output tile per program; ``bias`` ([2I], merged order for both
    layouts) is added here, in fp32, so the GEMM runs without it. ``QUANT_OUT`` (the FP8
    pipeline; BLOCK_N = 128): ``out`` re-quantized to e4m3 with one fp32 scale per row and 128
    columns, ``os [M, I/128]``, as the fused FP8 kernels' epilogue does. A pass at the copy
    bandwidth: 4 bytes read and 2 (e4m3: 1) written per output for a 16-bit ``y``."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < I)
    # gate and up columns of this tile (HBM -> registers)
    gate_col, up_col = _gate_up_rows(offs_n, I, PACKED, PACK)
    rows = y_ptr + offs_m[:, None] * stride_ym
    gate = tl.load(rows + gate_col[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(rows + up_col[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        gate += tl.load(bias_ptr + offs_n, mask=offs_n < I, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias_ptr + I + offs_n, mask=offs_n < I, other=0.0).to(tl.float32)[None, :]
    # SiLU * mul in fp32, one rounding or one re-quantization (registers -> HBM)
    store_h(_silu_mul(gate, up), out_ptr, os_ptr, offs_m, offs_n, stride_om, stride_os_m, pid_n, mask, M, QUANT_OUT)
