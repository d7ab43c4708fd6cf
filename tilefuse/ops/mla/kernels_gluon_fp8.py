"""Gluon dense MLA decode over an FP8 latent cache for Hopper (DeepSeek-V3.2's 656-byte layout):
pages by TMA into an mbarrier ring filled by a producer warp, dequantized by the consumer warps
into an fp16 K tile, transposed WGMMAs (paper 3's orientation: nothing padded to 64 rows).

The ``tl`` split kernels read the FP8 rows with their own loads and wait for each tile (2-3x the
bf16 Gluon kernel's time on the same lengths). Here the copies run ahead of the math:

* **Copy** (HBM -> SMEM, TMA, producer warp): a tile is 64 cached tokens of one request (one
  64-token page, or whole smaller pages side by side), each a 656-byte row: 512 e4m3 codes, 4 fp32
  scales (one per 128 codes), 64 bf16 RoPE values. Six boxes per tile land in ring slot
  ``tile % STAGES``: the codes as four ``[64, 128]`` byte boxes (one 128-byte swizzle row each),
  the RoPE bytes as one more (whose 128-byte swizzled layout is the 16-bit ``[64, 64]`` WGMMA
  operand's, so the tensor cores read it where it landed) and the scales as a ``[64, 4]`` fp32
  box. The producer walks the program's run of splits ahead of the consumers, so the next split's
  first tiles land while the current one ends.
* **Dequantize** (SMEM -> registers -> SMEM): each code to fp16 (exact; one conversion per two
  codes, where fp32 and a rounding to bf16 cost three per code) times its group's scale, rounded
  once to fp16, into the K tile ``[64, 512]`` in WGMMA's layout (Q's 512-wide part is fp16 too,
  the RoPE products stay bf16); rows past the request's length become 0 (a TMA box copies whole
  pages: NaN there must not reach ``0 x NaN`` in P V). Values must lie in fp16's range (65504),
  as normalized latents do.
* **Transposed products**: ``S^T = K Q^T`` ([64 tokens, BLOCK_H rows], Q resident in SMEM), the
  online softmax down the token axis, ``O^T = V^T P^T`` ([512, BLOCK_H] fp32) with V^T the K
  tile read transposed and P^T through SMEM. At 16-32 query rows a 64-row tile would do 2-4x the
  MMA work and turn the 656-byte read compute-bound; transposed, the work is the rows'.

Two forms of one kernel (``CONVERTERS``): the serial one described above (one consumer partition
converts a tile, then multiplies it), and the warp-specialized one of ``kernels_gluon_fp8_ws``
(the default: converter warps fill two K buffers while one MMA warpgroup works on the other),
which has its own ring of smaller slots.

Grid and schedule are the bf16 Gluon kernel's (``kernels_gluon.mla_split_ws_kernel``): one program
per (head tile, run of splits in the metadata's column 7), head tiles of BLOCK_H = 16 or 32 query
rows (up to ``configs.FP8_GLUON_MAX_ROWS``: past 32 rows, several tiles, each streaming its part's
pages); a request with several splits writes partials that ``kernels.mla_combine_kernel`` merges.
Measured, and why it stops where it does: docs/mla.md ("Dense FP8 decode").
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tilefuse.ops.gluon_compat import (fence_async_shared, mbarrier, smem_reinterpret, thread_barrier,
                                       warpgroup_mma, warpgroup_mma_wait)
from tilefuse.ops.mla.kernels_gluon import _program_run, _ws_store_lse
from tilefuse.ops.mla.kernels_gluon_fp8_rs import fp8_rs_body
from tilefuse.ops.mla.kernels_gluon_fp8_ws import (BLOCK_N, CODE_BOX, CODE_BOXES, D_NOPE, D_ROPE, FLAT, ROPE_SMEM,
                                                  SCALES, _issue_slot, fp8_ws_converter, fp8_ws_mma, fp8_ws_producer,
                                                  load_q_rows, split_work)
from tilefuse.ops.mla.kernels_gluon_sparse import _softmax_pv_transposed


@gluon.jit
def _fp8_producer(codes_desc, scales_desc, codes_ring, rope_ring, scales_ring, k_ready, k_empty, bt_ptr, stride_btb,
                  meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, num_blocks, slot_first, slot_last,
                  STAGES: gl.constexpr, KV_PAGE: gl.constexpr):
    t = 0
    for slot in range(slot_first, slot_last):
        valid, req, tok_begin, tok_end, length, n_part, part_idx = split_work(
            meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot)
        if valid:
            bt_row = bt_ptr + req * stride_btb
            last_page = gl.maximum(tok_end - 1, 0) // KV_PAGE
            for start in range(tok_begin, tok_end, BLOCK_N):
                # slot t % STAGES is free once the consumers released tile t - STAGES (a fresh
                # barrier passes the parity-1 wait: the first round finds every slot free)
                mbarrier.wait(k_empty.index(t % STAGES), ((t // STAGES) & 1) ^ 1)
                _issue_slot(codes_desc, scales_desc, codes_ring, rope_ring, scales_ring, k_ready.index(t % STAGES),
                            bt_row, start, t % STAGES, last_page, num_blocks, KV_PAGE, BLOCK_N)
                t += 1


@gluon.jit
def _dequantize_tile(codes_ring, scales, stage, k_nope, start, length, CODES_L: gl.constexpr, ROWS: gl.constexpr):
    """SMEM -> registers -> SMEM: slot ``stage``'s codes x their group's scale into the fp16 K tile,
    ``ROWS`` rows of one 128-code group at a time (few registers held); rows at or past ``length``
    as 0. e4m3 -> fp16 is exact and one conversion per two codes; the product is rounded once to
    fp16 (3 more bits than the bf16 values of ``mla_dequantize_kv``). The
    layout walks 8 rows per 8 threads at the same columns, so each 16-byte access of a phase lands
    in a different swizzled bank group."""
    scale32 = smem_reinterpret(scales, gl.float32, [BLOCK_N, SCALES], FLAT)
    for r in gl.static_range(0, BLOCK_N, ROWS):
        pos = start + r + gl.arange(0, ROWS, layout=gl.SliceLayout(1, CODES_L))
        keep = (pos < length)[:, None]
        for b in gl.static_range(CODE_BOXES):
            scale = scale32.slice(r, ROWS, dim=0).slice(b, 1, dim=1).load(CODES_L)            # [ROWS, 1]
            codes = codes_ring.index(stage * CODE_BOXES + b).slice(r, ROWS, dim=0).load(CODES_L)
            v = codes.to(gl.float16) * scale.to(gl.float16)                                   # [ROWS, 128]
            v = gl.where(keep, v, gl.zeros_like(v))
            k_nope.slice(r, ROWS, dim=0).slice(b * CODE_BOX, CODE_BOX, dim=1).store(v.to(k_nope.dtype))


@gluon.jit
def _store_rows(o, k_nope, pid_h, req, part_idx, n_part, rows_total, h_q, out_ptr, oacc_ptr, stride_ob, stride_os,
                stride_oh, BLOCK_H: gl.constexpr, NUM_WARPS: gl.constexpr):
    """registers -> SMEM -> HBM: the normalised O^T ``[512, BLOCK_H]`` fp32 of a split, final
    (q's dtype) or partial (fp32). It goes through the K tile's bytes (free: the last P V has been
    waited for), so each thread then stores 4 contiguous columns of a row instead of single values
    (and holds one address per 4 values)."""
    stage = smem_reinterpret(k_nope, gl.float32, [D_NOPE, BLOCK_H], FLAT)
    thread_barrier()                      # every warp's last reads of the K tile are done
    stage.store(o)
    thread_barrier()
    OUT: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, NUM_WARPS], [0, 1])
    CHUNK: gl.constexpr = 128
    rows = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, OUT))
    ok = (rows < rows_total)[None, :]
    dims = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, OUT))[:, None]
    final = out_ptr + req * stride_ob + (rows // h_q) * stride_os + (rows % h_q) * stride_oh
    partial = oacc_ptr + (part_idx * rows_total + rows).to(gl.int64) * D_NOPE
    for c in gl.static_range(0, D_NOPE, CHUNK):
        v = stage.slice(c, CHUNK, dim=0).load(OUT)
        if n_part == 1:
            gl.store(final[None, :] + c + dims, v.to(out_ptr.dtype.element_ty), mask=ok)
        else:
            gl.store(partial[None, :] + c + dims, v, mask=ok)
    thread_barrier()                      # the next split's dequantization overwrites these bytes


@gluon.jit
def _fp8_consumer(q_ptr, q_nope, q_rope, codes_ring, rope_ring, scales_ring, k_nope, p_t, k_ready, k_empty, meta_ptr,
                  splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot_first, slot_last, pid_h, h_q, s_q,
                  qk_scale, rows_total, out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, stride_qb, stride_qs, stride_qh,
                  stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                  CAUSAL: gl.constexpr, BLOCK_H: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr):
    # S^T and O^T as WGMMA accumulates them (8 warps: each warpgroup half of the rows), the
    # dequantization's layout (16 codes per thread, threads down the rows).
    WG: gl.constexpr = NUM_WARPS // 4
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                  instr_shape=[16, BLOCK_H // WG, 16])
    ROWS: gl.constexpr = gl.SliceLayout(0, S_L)          # query rows (N)
    TOKENS: gl.constexpr = gl.SliceLayout(1, S_L)        # cached tokens, or output columns (M)
    CODES_L: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [NUM_WARPS, 1], [0, 1])
    rows = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROWS)
    t = 0
    for slot in range(slot_first, slot_last):
        valid, req, tok_begin, tok_end, length, n_part, part_idx = split_work(
            meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot)
        if valid:
            # ---- this split's Q (the last split's products have all been waited for).
            load_q_rows(q_ptr, q_nope, q_rope, req, pid_h, h_q, rows_total, stride_qb, stride_qs, stride_qh,
                        BLOCK_H, NUM_WARPS)
            # causal: query token r // h_q of s_q sees keys up to L - s_q + r // h_q
            limit = length - 1 - gl.where(CAUSAL, s_q - 1 - rows // h_q, 0)
            m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROWS)
            l_i = gl.zeros([BLOCK_H], gl.float32, ROWS)
            acc = gl.zeros([D_NOPE, BLOCK_H], gl.float32, S_L)
            for start in range(tok_begin, tok_end, BLOCK_N):
                stage = t % STAGES
                mbarrier.wait(k_ready.index(stage), (t // STAGES) & 1)
                # ---- codes -> 16-bit K tile (the previous tile's P V has been waited for).
                _dequantize_tile(codes_ring, scales_ring.index(stage), stage, k_nope, start, length, CODES_L,
                                 8 * NUM_WARPS)
                fence_async_shared()
                thread_barrier()
                # ---- S^T = K Q^T: [64, 576] x [576, BLOCK_H]; the RoPE part read where it landed.
                rope = smem_reinterpret(rope_ring.index(stage), q_rope.dtype, [BLOCK_N, D_ROPE], ROPE_SMEM)
                s = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, S_L)
                s = warpgroup_mma(k_nope, q_nope.permute((1, 0)), s, use_acc=False, is_async=True)
                s = warpgroup_mma(rope, q_rope.permute((1, 0)), s, is_async=True)
                s = warpgroup_mma_wait(0, deps=(s,))
                mbarrier.arrive(k_empty.index(stage))          # the slot is read: the producer may refill it
                # ---- online softmax down the token axis (keys past the length or the causal
                #      limit score -inf), then O^T = O^T alpha + V^T P^T.
                pos = start + gl.arange(0, BLOCK_N, layout=TOKENS)
                m_i, l_i, acc = _softmax_pv_transposed(s, pos[:, None] <= limit[None, :], qk_scale, m_i, l_i, acc,
                                                       k_nope, p_t)
                t += 1
            # ---- registers -> HBM: the normalised output (one split) or partial, and the lse.
            has_keys = l_i != 0                 # NaN counts as keys: a NaN score reaches out and lse
            l_safe = gl.where(has_keys, l_i, 1.0)
            _store_rows(acc / l_safe[None, :], k_nope, pid_h, req, part_idx, n_part, rows_total, h_q, out_ptr,
                        oacc_ptr, stride_ob, stride_os, stride_oh, BLOCK_H, NUM_WARPS)
            _ws_store_lse(gl.where(has_keys, m_i + gl.log2(l_safe), float("-inf")), rows, req, part_idx, n_part,
                          rows_total, h_q, lse_ptr, lseacc_ptr, stride_lb, stride_lh)


@gluon.jit
def mla_split_fp8_kernel(
    q_ptr, codes_desc, scales_desc, bt_ptr, seqlens_ptr, meta_ptr, splits_ptr,
    out_ptr, lse_ptr, oacc_ptr, lseacc_ptr,
    batch, h_q, s_q, rows_total, num_slots, num_blocks, max_tokens, qk_scale,
    stride_qb, stride_qs, stride_qh, stride_btb,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    CAUSAL: gl.constexpr, BLOCK_H: gl.constexpr, STAGES: gl.constexpr, KV_PAGE: gl.constexpr,
    num_warps: gl.constexpr, SLOT_N: gl.constexpr = 64, CONVERTERS: gl.constexpr = 0, MMA_AHEAD: gl.constexpr = 0,
    SKIP: gl.constexpr = 0, RS: gl.constexpr = 0,
):
    """Attention of BLOCK_H query rows (bf16 q) over the splits of one part of the schedule, from an
    FP8 cache. ``CONVERTERS = 0`` (the serial form): a producer warp and ``num_warps`` consumer
    warps (4, or 8 with the two warpgroups each holding half of the rows) that convert and multiply
    in turn, ring slots of 64 tokens (``SLOT_N``). ``CONVERTERS > 0`` (``kernels_gluon_fp8_ws``): a
    producer warp filling a ring of ``STAGES`` slots of ``SLOT_N`` tokens, ``CONVERTERS`` warps
    converting into two K buffers, and the ``num_warps = 4`` MMA warpgroup (``MMA_AHEAD``: the next
    tile's ``S^T`` issued behind ``P V``). ``SKIP`` (timing only, results wrong): 1 leaves out the
    conversion, 2 the products, 3 both, so that what remains is timed alone. ``RS = 1``
    (``kernels_gluon_fp8_rs``): a producer warp filling ``STAGES`` slots of 64 tokens and the
    ``num_warps = 4`` MMA warpgroup, which converts the codes into the WGMMAs' register operands
    (no 16-bit K tile in shared memory).

    Grid: (head tiles, metadata rows - 1); program p runs slots ``meta[p, 7] .. meta[p + 1, 7] - 1``.
    codes_desc: TMA descriptor over the cache as ``[num_blocks * KV_PAGE, 656]`` float8_e4m3fn
    rows, boxes of ``[min(KV_PAGE, SLOT_N), 128]`` (the codes at columns 0, 128, 256, 384, the RoPE
    bytes at 528); scales_desc: over the same rows as fp32 from byte 512, ``[rows, 4]`` of stride
    164, boxes of ``[min(KV_PAGE, SLOT_N), 4]``. Scores in the log2 domain (``qk_scale = softmax_scale
    * log2(e)``). Outputs and partials as ``mla_split_ws_kernel``'s."""
    pid_h, slot_first, slot_last = _program_run(meta_ptr, num_slots)
    if slot_first == slot_last:
        return
    if RS:
        fp8_rs_body(q_ptr, codes_desc, scales_desc, bt_ptr, seqlens_ptr, meta_ptr, splits_ptr, out_ptr, lse_ptr, oacc_ptr,
                    lseacc_ptr, batch, h_q, s_q, rows_total, num_slots, num_blocks, max_tokens, qk_scale, stride_qb,
                    stride_qs, stride_qh, stride_btb, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, pid_h,
                    slot_first, slot_last, CAUSAL, BLOCK_H, STAGES, KV_PAGE, SLOT_N, SKIP, RS)
    elif CONVERTERS > 0:
        _fp8_ws_body(q_ptr, codes_desc, scales_desc, bt_ptr, seqlens_ptr, meta_ptr, splits_ptr, out_ptr, lse_ptr,
                     oacc_ptr, lseacc_ptr, batch, h_q, s_q, rows_total, num_slots, num_blocks, max_tokens, qk_scale,
                     stride_qb, stride_qs, stride_qh, stride_btb, stride_ob, stride_os, stride_oh, stride_lb,
                     stride_lh, pid_h, slot_first, slot_last, CAUSAL, BLOCK_H, STAGES, KV_PAGE, SLOT_N, CONVERTERS,
                     MMA_AHEAD, SKIP)
    else:
        _fp8_serial_body(q_ptr, codes_desc, scales_desc, bt_ptr, seqlens_ptr, meta_ptr, splits_ptr, out_ptr, lse_ptr,
                         oacc_ptr, lseacc_ptr, batch, h_q, s_q, rows_total, num_slots, num_blocks, max_tokens,
                         qk_scale, stride_qb, stride_qs, stride_qh, stride_btb, stride_ob, stride_os, stride_oh,
                         stride_lb, stride_lh, pid_h, slot_first, slot_last, CAUSAL, BLOCK_H, STAGES, KV_PAGE,
                         SLOT_N, num_warps)


@gluon.jit
def _fp8_serial_body(q_ptr, codes_desc, scales_desc, bt_ptr, seqlens_ptr, meta_ptr, splits_ptr, out_ptr, lse_ptr,
                     oacc_ptr, lseacc_ptr, batch, h_q, s_q, rows_total, num_slots, num_blocks, max_tokens, qk_scale,
                     stride_qb, stride_qs, stride_qh, stride_btb, stride_ob, stride_os, stride_oh, stride_lb,
                     stride_lh, pid_h, slot_first, slot_last, CAUSAL: gl.constexpr, BLOCK_H: gl.constexpr,
                     STAGES: gl.constexpr, KV_PAGE: gl.constexpr, SLOT_N: gl.constexpr, num_warps: gl.constexpr):
    """The serial form: ring slots of 64 tokens, consumers that convert, multiply and wait in turn."""
    gl.static_assert(SLOT_N == BLOCK_N, "the serial form's ring slots are 64-token tiles")
    dtype: gl.constexpr = gl.float16             # the dequantized K tile, Q's 512-wide part, P^T
    rope_t: gl.constexpr = q_ptr.dtype.element_ty  # bf16: the cache's RoPE part and Q's
    q_nope = gl.allocate_shared_memory(dtype, [BLOCK_H, D_NOPE],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_NOPE], dtype))
    q_rope = gl.allocate_shared_memory(rope_t, [BLOCK_H, D_ROPE],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_ROPE], rope_t))
    codes_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES * CODE_BOXES, BLOCK_N, CODE_BOX], codes_desc.layout)
    rope_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, CODE_BOX], codes_desc.layout)
    scales_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N, SCALES], scales_desc.layout)
    k_nope = gl.allocate_shared_memory(dtype, [BLOCK_N, D_NOPE],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_NOPE], dtype))
    p_t = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N],
                                    gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype))
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
    fence_async_shared()

    # (argument tuples written out in the call: a tuple held in a variable loses its constexprs)
    gl.warp_specialize([
        (_fp8_consumer, (q_ptr, q_nope, q_rope, codes_ring, rope_ring, scales_ring, k_nope, p_t, k_ready, k_empty,
                         meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot_first, slot_last, pid_h,
                         h_q, s_q, qk_scale, rows_total, out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, stride_qb, stride_qs,
                         stride_qh, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, CAUSAL, BLOCK_H, STAGES,
                         num_warps)),
        (_fp8_producer, (codes_desc, scales_desc, codes_ring, rope_ring, scales_ring, k_ready, k_empty, bt_ptr,
                         stride_btb, meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, num_blocks,
                         slot_first, slot_last, STAGES, KV_PAGE)),
    ], [1], [40])


@gluon.jit
def _fp8_ws_body(q_ptr, codes_desc, scales_desc, bt_ptr, seqlens_ptr, meta_ptr, splits_ptr, out_ptr, lse_ptr,
                 oacc_ptr, lseacc_ptr, batch, h_q, s_q, rows_total, num_slots, num_blocks, max_tokens, qk_scale,
                 stride_qb, stride_qs, stride_qh, stride_btb, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                 pid_h, slot_first, slot_last, CAUSAL: gl.constexpr, BLOCK_H: gl.constexpr, STAGES: gl.constexpr,
                 KV_PAGE: gl.constexpr, SLOT_N: gl.constexpr, CONVERTERS: gl.constexpr, MMA_AHEAD: gl.constexpr,
                 SKIP: gl.constexpr):
    """The warp-specialized form (``kernels_gluon_fp8_ws``): shared memory and barriers, then the
    MMA warpgroup (default partition), the converters and the producer."""
    dtype: gl.constexpr = gl.float16
    rope_t: gl.constexpr = q_ptr.dtype.element_ty
    gl.static_assert(BLOCK_N % SLOT_N == 0, "a K tile is whole ring slots")
    q_nope = gl.allocate_shared_memory(dtype, [BLOCK_H, D_NOPE],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_NOPE], dtype))
    q_rope = gl.allocate_shared_memory(rope_t, [BLOCK_H, D_ROPE],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_ROPE], rope_t))
    codes_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES * CODE_BOXES, SLOT_N, CODE_BOX], codes_desc.layout)
    rope_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, SLOT_N, CODE_BOX], codes_desc.layout)
    scales_ring = gl.allocate_shared_memory(gl.float32, [STAGES, SLOT_N, SCALES], scales_desc.layout)
    kn_buf = gl.allocate_shared_memory(dtype, [2, BLOCK_N, D_NOPE],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_NOPE], dtype))
    kr_buf = gl.allocate_shared_memory(rope_t, [2, BLOCK_N, D_ROPE], ROPE_SMEM)
    p_t = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N],
                                    gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype))
    r_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    r_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kb_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kb_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(r_ready.index(i), count=1)
        mbarrier.init(r_empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(kb_full.index(i), count=1)
        mbarrier.init(kb_empty.index(i), count=1)
    fence_async_shared()

    # registers: the converters hold 16 codes (and their fp16 products) at a time; the producer
    # only addresses; the MMA warpgroup (O^T: BLOCK_H / 2 fp32 registers a thread) the rest
    CONVERTER_REGS: gl.constexpr = 96 if CONVERTERS > 4 else 128
    # (argument tuples written out in the call: a tuple held in a variable loses its constexprs)
    gl.warp_specialize([
        (fp8_ws_mma, (q_ptr, q_nope, q_rope, kn_buf, kr_buf, p_t, kb_full, kb_empty, meta_ptr, splits_ptr,
                      seqlens_ptr, batch, num_slots, max_tokens, slot_first, slot_last, pid_h, h_q, s_q, qk_scale,
                      rows_total, out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, stride_qb, stride_qs, stride_qh, stride_ob,
                      stride_os, stride_oh, stride_lb, stride_lh, CAUSAL, BLOCK_H, MMA_AHEAD, SKIP, False)),
        (fp8_ws_converter, (codes_ring, rope_ring, scales_ring, kn_buf, kr_buf, r_ready, r_empty, kb_full, kb_empty,
                            meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot_first, slot_last,
                            STAGES, SLOT_N, SKIP)),
        (fp8_ws_producer, (codes_desc, scales_desc, codes_ring, rope_ring, scales_ring, r_ready, r_empty, bt_ptr,
                           stride_btb, meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, num_blocks,
                           slot_first, slot_last, STAGES, KV_PAGE, SLOT_N)),
    ], [CONVERTERS, 1], [CONVERTER_REGS, 40])
