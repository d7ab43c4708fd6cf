"""Gluon MLA split kernel for Hopper at few query rows (16-bit cache): transposed products, so
nothing is padded to WGMMA's 64 rows.

``kernels_gluon.mla_split_ws_kernel`` runs every row count as 64-row head tiles: at 16 query rows
per KV head three quarters of its tensor-core work (``S = Q K^T`` and ``P V``, 64 x 2 x 1088 FLOP
per cached token) is padding, and each 64-token tile costs about as much time on the tensor cores
as at 64 rows, close to the tile's share of HBM time on an H200. Here the cached tokens are
WGMMA's M and the query rows its N (paper 3's orientation, as in the FP8 kernel):

  producer (1 warp)       TMA: the program's tile ``t`` (64 tokens: the ``[64, 512]`` and
                          ``[64, 64]`` parts of each row, boxes of a page where pages are shorter)
                          -> K buffer ``t % 2``, once the MMA warpgroup released tile ``t - 2``
                          (``kernels_gluon._ws_producer``, the 64-row kernel's)
  MMA warpgroup (default, per split: Q (``BLOCK_H`` rows) -> SMEM; per tile: rows past the
  4 warps)                request's length zeroed in the buffer (its last tile only; a TMA box
                          copies whole pages, NaN there must not reach ``0 x NaN`` in P V),
                          ``S^T = K Q^T`` (``[64, BLOCK_H]``), the online softmax down the token
                          axis, ``O^T = O^T alpha + V^T P^T`` (``[512, BLOCK_H]`` fp32, V^T the
                          buffer read transposed), then the buffer released; the output leaves
                          through the split's last buffer before it is released
                          (``kernels_gluon_fp8_ws.fp8_ws_mma``, the FP8 kernel's MMA warpgroup,
                          with the tail zeroing on)

so per tile the tensor cores do the rows' work (``S^T``: 64 x BLOCK_H x 576, ``P V``: 512 x
BLOCK_H x 64) and read the K tile from shared memory once per product, about half the cycles of the
padded tile's, while the producer fills the other buffer.

Shared memory: two K buffers (2 x 72 KB, the cache's dtype), Q (``BLOCK_H x 1152`` B), P^T
(``BLOCK_H x 128`` B): 164 KB at 16 rows, 184 KB at 32 (a third K buffer does not fit beside Q).
Grid, metadata, partials and combine are the 64-row kernel's: one program per (head tile of
``BLOCK_H`` rows, run of splits in the metadata's column 7). Chosen by
``configs.TRANSPOSED_GLUON_MAX_ROWS`` (the Gluon kernel's form up to that many rows; 0, off, as
shipped): measured on an H200 it is 0.84-0.985x the 64-row kernel's speed at 4-32 rows (level at
2), which already streams at the copy bandwidth on long batches; docs/mla.md, "What was tried".
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tilefuse.ops.gluon_compat import fence_async_shared, mbarrier
from tilefuse.ops.mla.kernels_gluon import _program_run, _ws_producer
from tilefuse.ops.mla.kernels_gluon_fp8_ws import fp8_ws_mma
from tilefuse.ops.mla.reference import HEAD_DIM, HEAD_DIM_V

D_NOPE = gl.constexpr(HEAD_DIM_V)
D_ROPE = gl.constexpr(HEAD_DIM - HEAD_DIM_V)


@gluon.jit
def mla_split_t_kernel(
    q_ptr, kn_desc, kr_desc, bt_ptr, seqlens_ptr, meta_ptr, splits_ptr,
    out_ptr, lse_ptr, oacc_ptr, lseacc_ptr,
    batch, h_q, s_q, rows_total, num_slots, num_blocks, max_tokens, qk_scale,
    stride_qb, stride_qs, stride_qh, stride_btb,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, KV_PAGE: gl.constexpr,
    BLOCK_H: gl.constexpr, num_warps: gl.constexpr,
):
    """Attention of BLOCK_H (16 or 32) query rows over the splits of one part of the schedule,
    transposed (cached tokens as WGMMA's M), on a producer warp and one MMA warpgroup
    (``num_warps = 4``, the default partition).

    Arguments as ``kernels_gluon.mla_split_ws_kernel``'s (the same descriptors: ``[., 512]`` and
    ``[., 64]`` boxes of ``min(KV_PAGE, BLOCK_N)`` rows; scores in the log2 domain), plus BLOCK_H.
    Grid: (head tiles of BLOCK_H rows, metadata rows - 1)."""
    gl.static_assert(BLOCK_N == 64, "K tiles of 64 tokens: WGMMA's M of S^T")
    gl.static_assert(STAGES == 2, "two K buffers (the MMA warpgroup alternates between them)")
    dtype: gl.constexpr = kn_desc.dtype
    pid_h, slot_first, slot_last = _program_run(meta_ptr, num_slots)
    if slot_first == slot_last:
        return
    q_nope = gl.allocate_shared_memory(dtype, [BLOCK_H, D_NOPE],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_NOPE], dtype))
    q_rope = gl.allocate_shared_memory(dtype, [BLOCK_H, D_ROPE],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_ROPE], dtype))
    kn_buf = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_NOPE], kn_desc.layout)
    kr_buf = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_ROPE], kr_desc.layout)
    p_t = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N],
                                    gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype))
    kb_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kb_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(kb_full.index(i), count=1)
        mbarrier.init(kb_empty.index(i), count=1)
    fence_async_shared()

    # (argument tuples written out in the call: a tuple held in a variable loses its constexprs)
    gl.warp_specialize([
        (fp8_ws_mma, (q_ptr, q_nope, q_rope, kn_buf, kr_buf, p_t, kb_full, kb_empty, meta_ptr, splits_ptr,
                      seqlens_ptr, batch, num_slots, max_tokens, slot_first, slot_last, pid_h, h_q, s_q, qk_scale,
                      rows_total, out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, stride_qb, stride_qs, stride_qh, stride_ob,
                      stride_os, stride_oh, stride_lb, stride_lh, CAUSAL, BLOCK_H, 0, 0, True)),
        (_ws_producer, (kn_desc, kr_desc, kn_buf, kr_buf, kb_full, kb_empty, bt_ptr, stride_btb, meta_ptr,
                        splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, num_blocks, slot_first, slot_last,
                        BLOCK_N, STAGES, KV_PAGE, 0)),
    ], [1], [40])
