"""Triton kernel of the FP8 fused SwiGLU gate/up projection with scaled e4m3 inputs.

``h = silu(Xd Wgd^T) * (Xd Wud^T)`` where ``Xd = x * x_scales`` and ``Wd = w * w_scales`` are the
dequantized operands (e4m3 values times fp32 scales). The kernel never dequantizes: the tensor
core multiplies the e4m3 tiles (fp32 accumulation) and the scales are applied to the fp32
products, per K block where they vary along K:

* block scaling (DeepSeek-V3's recipe): ``x_scales [M, K/128]`` (one scale per token and 1 x 128
  group of K), ``w_scales [2I/128, K/128]`` (one scale per 128 x 128 weight block). Each 128-wide
  K step's product ``x_k w_k^T`` starts from zero in the tensor core and is added to the fp32
  total times ``x_scale[m, k] * w_scale[n/128, k]``.
* per-token / per-channel scaling (Llama FP8 checkpoints, ``torch._scaled_mm`` row-wise):
  ``x_scales [M, 1]``, ``w_scales [2I, 1]``; constant along K, so the products chain in the tensor
  core and the scales multiply the finished accumulator once. Either side may be of either kind.

Epilogue: SiLU * mul in fp32 on the scaled gate and up accumulators, then either one rounding to
bf16/fp16, or a re-quantization to e4m3 with one fp32 scale per token and 1 x 128 group of output
columns (``scale = amax / 448``, 1 for an all-zero group), the layout the down projection's
block-scaled GEMM takes: the ``[M, 2I]`` intermediate never reaches HBM, nor a bf16 ``[M, I]``.

Weight layout: merged ``[2I, K]`` (gate rows, then up rows), viewed as ``[2, I, K]`` so one 3-D TMA
box ``[2, BLOCK_N, BLOCK_K]`` holds a tile's gate and up rows and one dot of N = 2 BLOCK_N feeds
the tensor core per K step (as the bf16 large-M kernel does).

Two kernels: ``swiglu_fp8_kernel`` (TMA, 64-128-row tiles, one program per output tile) and, for
decode (M <= 16), ``swiglu_fp8_decode_kernel``: there the weight stream is the whole cost, and a
program per output tile leaves too few bytes in flight (a 7B MLP at M = 1 has 296 tiles of 64
columns), so the decode kernel splits K as well, over 16-row tiles, as the bf16 small-M kernel does.
"""

import triton
import triton.language as tl

from tilefuse.ops.tl_common import (grouped_tile, load_gate_up_step, quantize_rows, split_k_gate_up, split_k_tile,
                                    store_h)

WBLOCK = tl.constexpr(128)      # weight block edge of block scaling


@triton.jit
def swiglu_fp8_kernel(
    # TMA descriptors (host-side) and plain pointers
    x_desc, w_desc, out_desc, xs_ptr, ws_ptr, os_ptr,
    # sizes
    M, I, K,
    # scale strides: x_scales [M, K/128 or 1], w_scales [2I/128, K/128] or [2I, 1], out_scales [M, I/128]
    stride_xs_m, stride_xs_k, stride_ws_n, stride_ws_k, stride_os_m,
    # meta-parameters
    X_GROUPED: tl.constexpr, W_BLOCKED: tl.constexpr, QUANT_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROMOTE: tl.constexpr = 1,
):
    """One program = one [BLOCK_M, BLOCK_N] output tile (a BLOCK_M x 2 BLOCK_N GEMM tile).

    Grid: (cdiv(M, BLOCK_M) * cdiv(I, BLOCK_N),) in grouped order. With block-scaled operands
    BLOCK_K = 128 (one scale per K step) and BLOCK_N divides 128 (a tile's gate rows, and its up
    rows, lie in one weight block); QUANT_OUT needs BLOCK_N = 128 (one output group per tile row).
    x_desc boxes [BLOCK_M, BLOCK_K], w_desc [2, BLOCK_N, BLOCK_K] over the weight viewed as
    [2, I, K], out_desc [BLOCK_M, BLOCK_N].
    """
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(I, BLOCK_N), GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    # Scale rows: out-of-range tokens are clamped to the last one (their outputs are not stored).
    rows = tl.minimum(off_m + tl.arange(0, BLOCK_M), M - 1)
    is_gate = tl.arange(0, 2 * BLOCK_N) < BLOCK_N
    k_steps = tl.cdiv(K, BLOCK_K)

    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    part = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    # Main loop: HBM -TMA-> SMEM (ring of num_stages) -WGMMA (e4m3 x e4m3 -> fp32)-> registers.
    # TMA zero-fills rows past M and I (each plane of the [2, I, K] view) and the K tail.
    for ks in range(k_steps):
        x = x_desc.load([off_m, ks * BLOCK_K])
        w = w_desc.load([0, off_n, ks * BLOCK_K]).reshape(2 * BLOCK_N, BLOCK_K)
        if X_GROUPED or W_BLOCKED:
            # Scales that vary along K: this K block's product is scaled in fp32 before it joins
            # the total (x: one scale per row; w: one for the gate block, one for the up block).
            part = tl.dot(x, w.T)
            if X_GROUPED:
                part = part * tl.load(xs_ptr + rows * stride_xs_m + ks * stride_xs_k)[:, None]
            if W_BLOCKED:
                ws_gate = tl.load(ws_ptr + (off_n // WBLOCK) * stride_ws_n + ks * stride_ws_k)
                ws_up = tl.load(ws_ptr + ((I + off_n) // WBLOCK) * stride_ws_n + ks * stride_ws_k)
                part = part * tl.where(is_gate, ws_gate, ws_up)[None, :]
            acc += part
        else:
            # Scales constant along K: chain PROMOTE K blocks in the tensor core, then add them to
            # the fp32 total. Hopper's FP8 WGMMA keeps ~14 bits of its running sum (products are
            # aligned to the largest and truncated), so a whole K chained there drifts past
            # cuBLASLt's error; short chains keep the error of one K block.
            part = tl.dot(x, w.T, part)
            if ks % PROMOTE == PROMOTE - 1:
                acc += part
                part = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    if not (X_GROUPED or W_BLOCKED):
        acc += part

    # Scales constant along K multiply the finished accumulator: per token (rows) and per weight
    # row (columns: gate rows off_n.., up rows I + off_n..; clamped at I, dropped by the store).
    if not X_GROUPED:
        acc = acc * tl.load(xs_ptr + rows * stride_xs_m)[:, None]
    if not W_BLOCKED:
        cols = tl.minimum(off_n + tl.arange(0, 2 * BLOCK_N) % BLOCK_N, I - 1)
        acc = acc * tl.load(ws_ptr + (cols + tl.where(is_gate, 0, I)) * stride_ws_n)[None, :]

    # Epilogue: split the gate | up halves, SiLU * mul in fp32.
    gate, up = tl.split(acc.reshape(BLOCK_M, 2, BLOCK_N).permute(0, 2, 1))
    h = gate * tl.sigmoid(gate) * up
    if QUANT_OUT:
        # Re-quantize each row's 128 columns (one group) to e4m3: scale = amax / 448 (1 for an
        # all-zero group), values h / scale clamped to +-448 (no NaN from a rounding overshoot);
        # the scales go to out_scales[m, n / 128].
        q, scale = quantize_rows(h)
        out_desc.store([off_m, off_n], q.to(out_desc.dtype))
        offs_m = off_m + tl.arange(0, BLOCK_M)
        tl.store(os_ptr + offs_m * stride_os_m + pid_n, scale, mask=offs_m < M)
    else:
        # One rounding to the output dtype; the TMA store clips at M and I.
        out_desc.store([off_m, off_n], h.to(out_desc.dtype))


@triton.jit
def swiglu_fp8_decode_kernel(
    # pointers: x [M, K] e4m3, w [2I, K] e4m3, scales (fp32), out [M, I], out_scales [M, I/128],
    # the split-K workspace [SPLIT_K, 2, M, I] fp32 and its tickets [tiles] int32 (zero)
    x_ptr, w_ptr, xs_ptr, ws_ptr, out_ptr, os_ptr, part_ptr, lock_ptr,
    # sizes
    M, I, K,
    # strides (unit last strides), scale strides as swiglu_fp8_kernel takes them
    stride_xm, stride_wn, stride_om, stride_xs_m, stride_xs_k, stride_ws_n, stride_ws_k, stride_os_m,
    # 0.0 at run time: each K block's product starts from a zero the compiler cannot fold away
    acc_zero,
    # meta-parameters
    X_GROUPED: tl.constexpr, W_BLOCKED: tl.constexpr, QUANT_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    """One program = one [BLOCK_M, BLOCK_N] output tile over one K slice (of SPLIT_K).

    Grid: (cdiv(I, BLOCK_N), cdiv(M, BLOCK_M), SPLIT_K), n fastest. K steps of 128 (one scale
    block). BLOCK_N divides 128 (a tile's gate rows, and its up rows, lie in one weight block);
    QUANT_OUT needs BLOCK_N = 128 (one output group per tile row).
    """
    # This program's tile and K slice, in whole 128-wide blocks; out-of-range rows / columns
    # clamped to the last valid one (unmasked loads in the loop), dropped by the store mask.
    pid_m, pid_n, pid_k, offs_m, offs_n, rows, cols, k_begin, k_end = split_k_tile(
        M, I, K, BLOCK_M, BLOCK_N, WBLOCK, SPLIT_K)
    offs_k = k_begin * WBLOCK + tl.arange(0, WBLOCK)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
    wg_ptrs = w_ptr + cols[:, None] * stride_wn + offs_k[None, :]
    wu_ptrs = w_ptr + (I + cols)[:, None] * stride_wn + offs_k[None, :]
    xs_ptrs = xs_ptr + rows * stride_xs_m + k_begin * stride_xs_k
    wsg_ptr = ws_ptr + (pid_n * BLOCK_N // WBLOCK) * stride_ws_n + k_begin * stride_ws_k
    wsu_ptr = ws_ptr + ((I + pid_n * BLOCK_N) // WBLOCK) * stride_ws_n + k_begin * stride_ws_k

    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Main loop: HBM -> registers (software-pipelined through SMEM by num_stages): x [BM, 128] and
    # the gate and up weight rows [BN, 128] of a K block, e4m3; each product fresh in the tensor
    # core (fp32), scaled where the scales vary along K, added to the fp32 sums.
    for ks in range(k_begin, k_end):
        x, wg, wu = load_gate_up_step(x_ptrs, wg_ptrs, wu_ptrs, ks, K, WBLOCK, EVEN_K, rows, False)
        zero = tl.full((BLOCK_M, BLOCK_N), acc_zero, tl.float32)
        part_g = tl.dot(x, tl.trans(wg), zero)
        part_u = tl.dot(x, tl.trans(wu), zero)
        if X_GROUPED:
            x_scale = tl.load(xs_ptrs)[:, None]
            part_g = part_g * x_scale
            part_u = part_u * x_scale
            xs_ptrs += stride_xs_k
        if W_BLOCKED:
            part_g = part_g * tl.load(wsg_ptr)
            part_u = part_u * tl.load(wsu_ptr)
            wsg_ptr += stride_ws_k
            wsu_ptr += stride_ws_k
        acc_g += part_g
        acc_u += part_u
        x_ptrs += WBLOCK
        wg_ptrs += WBLOCK
        wu_ptrs += WBLOCK

    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < I)
    last = True
    if SPLIT_K > 1:
        # Split-K fix-up: the last K slice of the tile to arrive sums the partials and finishes it.
        last, acc_g, acc_u = split_k_gate_up(acc_g, acc_u, part_ptr, lock_ptr, pid_m * tl.num_programs(0) + pid_n,
                                             pid_k, M * I, offs_m[:, None] * I + offs_n[None, :], out_mask, SPLIT_K)
    if last:
        # Epilogue (registers -> HBM): the scales constant along K, SiLU * mul in fp32, then one
        # rounding or an e4m3 re-quantization with the row's group scale (as swiglu_fp8_kernel).
        if not X_GROUPED:
            x_scale = tl.load(xs_ptr + rows * stride_xs_m)[:, None]
            acc_g = acc_g * x_scale
            acc_u = acc_u * x_scale
        if not W_BLOCKED:
            acc_g = acc_g * tl.load(ws_ptr + cols * stride_ws_n)[None, :]
            acc_u = acc_u * tl.load(ws_ptr + (I + cols) * stride_ws_n)[None, :]
        h = acc_g * tl.sigmoid(acc_g) * acc_u
        store_h(h, out_ptr, os_ptr, offs_m, offs_n, stride_om, stride_os_m, pid_n, out_mask, M, QUANT_OUT)
