"""The Gluon dense FP8 MLA decode in 64-row head tiles: the 16-bit kernel's two MMA warpgroups
(``kernels_gluon.mla_split_ws_kernel``), fed by a converter warpgroup instead of a TMA warp.

At 64-128 query rows per KV head the decode is bound by the tensor cores, not by HBM: the 16-bit
kernel's 64-row tiles run the products at their rate, while the transposed FP8 forms
(``kernels_gluon_fp8``) hold at most 32 rows per tile, so 128 rows stream every page four times.
This kernel keeps the 16-bit kernel's partitions and products as they are and changes only where
its K tiles come from:

  softmax warpgroup (default,  per split: Q -> SMEM (512-wide part as fp16); per tile: ``S = Q K^T``, the
  4 warps)                     online softmax, ``O[:, :256] += P V[:, :256]``; P and alpha -> SMEM
  PV warpgroup (4 warps)       per tile: ``O[:, 256:] += P V[:, 256:]`` (P from SMEM)
  converter warpgroup          per 64-token tile: its 656-byte rows HBM -> registers (16-byte loads,
  (4 warps)                    issued before it waits for a free K slot, so they fly while the
                               products run; the rows of the tile ahead asked of L2 first), each
                               code to fp16 x its group's scale, and the RoPE values -> K slot
                               ``t % STAGES`` in WGMMA's layout (rows past the request's length as
                               0); then the slot is full

No raw-code ring sits in shared memory: the converter's registers are the staging buffer, so Q
(72 KB) and two 72 KB K slots fit as in the 16-bit kernel, and the tensor cores read the same
16-bit tiles at the same rate. The codes' part of K is fp16 (e4m3 -> fp16 is one conversion per two
codes and exact; the products one HMUL2 per two): through fp32 and a rounding to bf16 it took four
conversions per two codes, and the converter was bound by Hopper's conversion rate. So Q's 512-wide
part is converted to fp16 as it is loaded and P is fp16; the RoPE parts stay bf16 (their own WGMMA
into the same accumulator). Values must lie in fp16's range (65504), as normalized latents do.

Accuracy: K's codes part is the cache's dequantized values with the scale rounded to fp16 and the
product rounded once to fp16 (relative 2^-11 each), P rounds to fp16 (the 16-bit path: bf16).
Grid, schedule, partials and the combine are the 16-bit kernel's.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tilefuse.ops.gluon_compat import fence_async_shared, mbarrier, smem_reinterpret, thread_barrier
from tilefuse.ops.mla.kernels_gluon import (BLOCK_H, _gdc_launch_dependents, _program_run, _split_range, _ws_pv,
                                           _ws_shared, _ws_softmax)
from tilefuse.ops.mla.reference import FP8_GROUP, FP8_KV_BYTES, HEAD_DIM, HEAD_DIM_V

D_NOPE = gl.constexpr(HEAD_DIM_V)
D_ROPE = gl.constexpr(HEAD_DIM - HEAD_DIM_V)
GROUP = gl.constexpr(FP8_GROUP)                  # codes per scale
ROW_BYTES = gl.constexpr(FP8_KV_BYTES)           # 512 codes, 4 fp32 scales, 64 bf16 RoPE values
SCALE_BYTE = gl.constexpr(HEAD_DIM_V)
ROPE_BYTE = gl.constexpr(HEAD_DIM_V + 4 * (HEAD_DIM_V // FP8_GROUP))
K_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
K_SMEM32 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))  # the same bytes


@gluon.jit
def _tile_rows(bt_row, start, length, last_page, num_blocks, ROWS_L: gl.constexpr, BLOCK_N: gl.constexpr,
               KV_PAGE: gl.constexpr):
    """The cache rows (int64) of tokens ``start .. start + BLOCK_N - 1`` and which of them are the
    request's (``< length``): pages from the block table, column clamped to the split's last page,
    entry clamped to the cache."""
    pos = start + gl.arange(0, BLOCK_N, layout=ROWS_L)
    page = gl.load(bt_row + gl.minimum(pos // KV_PAGE, last_page))
    page = gl.minimum(gl.maximum(page, 0), num_blocks - 1)
    return page.to(gl.int64) * KV_PAGE + pos % KV_PAGE, pos < length


@gluon.jit
def _prefetch_tile(cache_ptr, bt_row, start, tok_end, last_page, num_blocks, BLOCK_N: gl.constexpr,
                   KV_PAGE: gl.constexpr):
    """HBM -> L2: the 656-byte rows of tokens ``start ..`` before ``tok_end``, one prefetch per
    128-byte line (a 16-byte aligned row spans at most 6), so the converter's loads of the tile
    later meet L2's latency instead of HBM's; no register or shared memory holds anything."""
    PF_L: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [gl.num_warps(), 1], [1, 0])
    rows, keep = _tile_rows(bt_row, start, tok_end, last_page, num_blocks, gl.SliceLayout(1, PF_L), BLOCK_N, KV_PAGE)
    line = gl.arange(0, 8, layout=gl.SliceLayout(0, PF_L))
    addr = (cache_ptr + (rows * ROW_BYTES)[:, None] + (line * 128)[None, :]).to(gl.int64, bitcast=True)
    ok = (keep[:, None] & (line < 6)[None, :]).to(gl.int32)
    gl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
                              "=r,l,r", [addr, ok], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _load_codes(cache_ptr, rows, keep, g: gl.constexpr, CODES_L: gl.constexpr):
    """HBM -> registers: group ``g``'s 128 codes of each row (16 contiguous bytes per thread) and
    its fp32 scale; rows not kept as 0 (no byte read)."""
    cols = gl.arange(0, GROUP, layout=gl.SliceLayout(0, CODES_L))
    ptrs = cache_ptr + (rows * ROW_BYTES + g * GROUP)[:, None] + cols[None, :]
    codes = gl.load(gl.max_contiguous(gl.multiple_of(ptrs, [1, 16]), [1, 16]), mask=keep[:, None], other=0)
    scale_ptrs = (cache_ptr + rows * ROW_BYTES + SCALE_BYTE + 4 * g).to(gl.pointer_type(gl.float32), bitcast=True)
    return codes, gl.load(scale_ptrs, mask=keep, other=0.0)


@gluon.jit
def _load_rope(cache_ptr, rows, keep, ROPE_L: gl.constexpr):
    """HBM -> registers: the rows' 64 bf16 RoPE values (8 contiguous per thread); rows not kept as 0."""
    rows_r = gl.convert_layout(rows, gl.SliceLayout(1, ROPE_L))
    keep_r = gl.convert_layout(keep, gl.SliceLayout(1, ROPE_L))
    cols = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, ROPE_L))[None, :]
    ptrs = (cache_ptr + rows_r * ROW_BYTES + ROPE_BYTE).to(gl.pointer_type(gl.bfloat16), bitcast=True)[:, None] + cols
    return gl.load(gl.max_contiguous(gl.multiple_of(ptrs, [1, 16]), [1, 8]), mask=keep_r[:, None], other=0.0)


@gluon.jit
def _load_scales(cache_ptr, rows, keep):
    """HBM -> registers: the rows' four fp32 group scales as one [rows, 4] tensor split by group."""
    L4: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [gl.num_warps(), 1], [1, 0])
    r = gl.convert_layout(rows, gl.SliceLayout(1, L4))
    k = gl.convert_layout(keep, gl.SliceLayout(1, L4))
    g = gl.arange(0, 4, layout=gl.SliceLayout(0, L4))
    ptrs = (cache_ptr + r * ROW_BYTES + SCALE_BYTE).to(gl.pointer_type(gl.float32), bitcast=True)[:, None] + g[None, :]
    v = gl.load(ptrs, mask=k[:, None], other=0.0)
    a, b = gl.split(gl.reshape(v, [v.shape[0], 2, 2]))
    s0, s2 = gl.split(a)
    s1, s3 = gl.split(b)
    return s0, s1, s2, s3


@gluon.jit
def _load_words(cache_ptr, rows, keep, byte: gl.constexpr, WORDS: gl.constexpr, WORDS_L: gl.constexpr):
    """HBM -> registers: ``WORDS`` 32-bit words of each row from byte ``byte`` (4 per thread: 16
    bytes), packed as they are stored, so a tile carried across a loop iteration holds 4 codes or 2
    RoPE values per register; rows not kept as 0."""
    cols = gl.arange(0, WORDS, layout=gl.SliceLayout(0, WORDS_L))
    base = (cache_ptr + rows * ROW_BYTES + byte).to(gl.pointer_type(gl.int32), bitcast=True)
    ptrs = base[:, None] + cols[None, :]
    return gl.load(gl.max_contiguous(gl.multiple_of(ptrs, [1, 16]), [1, 4]), mask=keep[:, None], other=0)


@gluon.jit
def _store_words(kn, words, scale, g: gl.constexpr):
    """registers -> SMEM: group ``g``'s codes, 4 per 32-bit word, to fp16 pairs (one ``cvt`` per
    two codes) times the scale rounded to fp16 (one ``mul.f16x2`` per two), into columns ``g *
    128 ..`` of the fp16 K slot viewed as 32-bit pairs."""
    s16 = scale.to(gl.float16)
    pair = gl.inline_asm_elementwise("mov.b32 $0, {$1, $1};", "=r,h", [s16], dtype=gl.int32, is_pure=True, pack=1)
    lo, hi = gl.inline_asm_elementwise(
        "{ .reg .b16 a, b; .reg .b32 x, y; mov.b32 {a, b}, $2; cvt.rn.f16x2.e4m3x2 x, a; "
        "cvt.rn.f16x2.e4m3x2 y, b; mul.rn.f16x2 $0, x, $3; mul.rn.f16x2 $1, y, $3; }",
        "=r,=r,r,r", [words, gl.broadcast(words, pair[:, None])[1]], dtype=(gl.int32, gl.int32), is_pure=True,
        pack=1)
    v = gl.reshape(gl.join(lo, hi), [lo.shape[0], 2 * lo.shape[1]])
    view = smem_reinterpret(kn, gl.int32, [kn.shape[0], kn.shape[1] // 2], K_SMEM32)
    view.slice(g * GROUP // 2, GROUP // 2, dim=1).store(v)


@gluon.jit
def _store_group(kn, codes, scale, g: gl.constexpr):
    """registers -> SMEM: codes (e4m3 bytes) to fp16 (exact, one conversion per two codes) x their
    scale (rounded to fp16), the product rounded once to fp16, into columns ``g * 128 ..`` of the
    slot. (Through fp32 and a rounding to bf16 it takes four conversions per two codes, and
    Hopper converts at a fraction of its arithmetic rate: the converter was bound by them.)"""
    v = codes.to(gl.float8e4nv, bitcast=True).to(gl.float16) * scale.to(gl.float16)[:, None]
    kn.slice(g * GROUP, GROUP, dim=1).store(v)


@gluon.jit
def fp8_wide_converter(cache_ptr, kn_ring, kr_ring, k_ready, k_empty, bt_ptr, stride_btb, meta_ptr, splits_ptr,
                       seqlens_ptr, batch, num_slots, max_tokens, num_blocks, slot_first, slot_last,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, KV_PAGE: gl.constexpr,
                       PREFETCH: gl.constexpr, SKIP: gl.constexpr, PIPELINE: gl.constexpr):
    # Each thread holds 16 codes of a row per load (8 threads walk 8 rows at the same columns:
    # every 16-byte store of a phase lands in another swizzled bank group, and each warp's loads
    # cover whole 32-byte sectors); RoPE values 8 per thread the same way.
    NW: gl.constexpr = gl.num_warps()
    CODES_L: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [NW, 1], [0, 1])
    ROPE_L: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [NW, 1], [0, 1])
    ROWS_C: gl.constexpr = gl.SliceLayout(1, CODES_L)
    WORDS_L: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [NW, 1], [0, 1])     # 16 bytes per thread
    ROWS_W: gl.constexpr = gl.SliceLayout(1, WORDS_L)
    t = 0                                  # tiles converted so far (K slot and phases)
    for slot in range(slot_first, slot_last):
        valid, req, tok_begin, tok_end, length, n_part, part_idx, first = _split_range(
            meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots, max_tokens, slot)
        if valid:
            bt_row = bt_ptr + req * stride_btb
            last_page = gl.maximum(tok_end - 1, 0) // KV_PAGE
            # ---- HBM -> L2: the split's tiles 1 .. PREFETCH - 1 (tile 0 is loaded at once)
            for ahead in gl.static_range(1, PREFETCH):
                _prefetch_tile(cache_ptr, bt_row, tok_begin + ahead * BLOCK_N, tok_end, last_page, num_blocks,
                               BLOCK_N, KV_PAGE)
            if PIPELINE:
                gl.static_assert(SKIP % 2 == 0, "the pipelined converter always stores (SKIP 0 or 2)")
                # ---- HBM -> registers: the split's first tile (each later tile's words are loaded
                #      group by group while the tile before it is converted)
                rows, keep = _tile_rows(bt_row, tok_begin, tok_end, last_page, num_blocks, ROWS_W, BLOCK_N, KV_PAGE)
                if SKIP >= 2:          # (timing only: no row is read; the conversions stay)
                    keep = keep & (tok_begin < 0)
                w0 = _load_words(cache_ptr, rows, keep, 0 * GROUP, GROUP // 4, WORDS_L)
                w1 = _load_words(cache_ptr, rows, keep, 1 * GROUP, GROUP // 4, WORDS_L)
                w2 = _load_words(cache_ptr, rows, keep, 2 * GROUP, GROUP // 4, WORDS_L)
                w3 = _load_words(cache_ptr, rows, keep, 3 * GROUP, GROUP // 4, WORDS_L)
                wr = _load_words(cache_ptr, rows, keep, ROPE_BYTE, D_ROPE // 2, WORDS_L)
                sc = _load_scales(cache_ptr, rows, keep)
                for start in range(tok_begin, tok_end, BLOCK_N):
                    if PREFETCH > 0:
                        _prefetch_tile(cache_ptr, bt_row, start + PREFETCH * BLOCK_N, tok_end, last_page, num_blocks,
                                       BLOCK_N, KV_PAGE)
                    # the next tile's rows within the split (none past its end)
                    rows, keep = _tile_rows(bt_row, start + BLOCK_N, tok_end, last_page, num_blocks, ROWS_W, BLOCK_N,
                                            KV_PAGE)
                    if SKIP >= 2:
                        keep = keep & (start < 0)
                    stage = t % STAGES
                    mbarrier.wait(k_empty.index(stage), ((t // STAGES) & 1) ^ 1)
                    # ---- registers -> SMEM, one group at a time, each group's registers then
                    #      refilled with the next tile's (HBM -> registers under this conversion)
                    kn = kn_ring.index(stage)
                    _store_words(kn, w0, gl.convert_layout(sc[0], ROWS_W), 0)
                    w0 = _load_words(cache_ptr, rows, keep, 0 * GROUP, GROUP // 4, WORDS_L)
                    _store_words(kn, w1, gl.convert_layout(sc[1], ROWS_W), 1)
                    w1 = _load_words(cache_ptr, rows, keep, 1 * GROUP, GROUP // 4, WORDS_L)
                    _store_words(kn, w2, gl.convert_layout(sc[2], ROWS_W), 2)
                    w2 = _load_words(cache_ptr, rows, keep, 2 * GROUP, GROUP // 4, WORDS_L)
                    _store_words(kn, w3, gl.convert_layout(sc[3], ROWS_W), 3)
                    w3 = _load_words(cache_ptr, rows, keep, 3 * GROUP, GROUP // 4, WORDS_L)
                    smem_reinterpret(kr_ring.index(stage), gl.int32, [BLOCK_N, D_ROPE // 2], K_SMEM32).store(wr)
                    wr = _load_words(cache_ptr, rows, keep, ROPE_BYTE, D_ROPE // 2, WORDS_L)
                    sc = _load_scales(cache_ptr, rows, keep)
                    fence_async_shared()
                    thread_barrier()
                    mbarrier.arrive(k_ready.index(stage))
                    t += 1
            else:
                for start in range(tok_begin, tok_end, BLOCK_N):
                    # ---- HBM -> L2: the tile PREFETCH ahead, so its rows wait in L2 when they are loaded
                    if PREFETCH > 0:
                        _prefetch_tile(cache_ptr, bt_row, start + PREFETCH * BLOCK_N, tok_end, last_page, num_blocks,
                                       BLOCK_N, KV_PAGE)
                    # ---- HBM -> registers: the tile's rows (4 groups of codes and scales, RoPE),
                    #      issued before the wait for a free slot so that they are in flight while the
                    #      MMA warpgroups finish the tile that holds it.
                    rows, keep = _tile_rows(bt_row, start, length, last_page, num_blocks, ROWS_C, BLOCK_N, KV_PAGE)
                    if SKIP >= 2:          # (timing only: no row is read; the conversions stay)
                        keep = keep & (start < 0)
                    c0, s0 = _load_codes(cache_ptr, rows, keep, 0, CODES_L)
                    c1, s1 = _load_codes(cache_ptr, rows, keep, 1, CODES_L)
                    c2, s2 = _load_codes(cache_ptr, rows, keep, 2, CODES_L)
                    c3, s3 = _load_codes(cache_ptr, rows, keep, 3, CODES_L)
                    rope = _load_rope(cache_ptr, rows, keep, ROPE_L)
                    # ---- slot t % STAGES is free once both MMA warpgroups released tile t - STAGES
                    #      (a fresh barrier passes the parity-1 wait: the first round finds all free)
                    stage = t % STAGES
                    mbarrier.wait(k_empty.index(stage), ((t // STAGES) & 1) ^ 1)
                    # ---- registers -> SMEM: the dequantized 16-bit K tile in WGMMA's layout
                    kn = kn_ring.index(stage)
                    if (SKIP % 2 == 0) | (start < 0):     # (SKIP odd, timing only: loads kept, nothing stored)
                        _store_group(kn, c0, s0, 0)
                        _store_group(kn, c1, s1, 1)
                        _store_group(kn, c2, s2, 2)
                        _store_group(kn, c3, s3, 3)
                        kr_ring.index(stage).store(rope.to(kr_ring.dtype))
                    # ---- every warp's stores visible to the tensor cores, then the slot is handed over
                    fence_async_shared()
                    thread_barrier()
                    mbarrier.arrive(k_ready.index(stage))
                    t += 1


@gluon.jit
def mla_split_fp8_wide_kernel(
    q_ptr, cache_ptr, bt_ptr, seqlens_ptr, meta_ptr, splits_ptr,
    out_ptr, lse_ptr, oacc_ptr, lseacc_ptr,
    batch, h_q, s_q, rows_total, num_slots, num_blocks, max_tokens, qk_scale,
    stride_qb, stride_qs, stride_qh, stride_btb,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, KV_PAGE: gl.constexpr, PDL: gl.constexpr,
    PV_REGS: gl.constexpr, CONVERTER_REGS: gl.constexpr, num_warps: gl.constexpr, PREFETCH: gl.constexpr = 0,
    SKIP: gl.constexpr = 0, PIPELINE: gl.constexpr = 0,
):
    """Attention of 64 query rows (16-bit q) over the splits of one part of the schedule from an FP8
    cache (``cache_ptr``: ``[num_blocks * KV_PAGE, 656]`` bytes, rows 16-byte aligned), on the
    16-bit kernel's softmax warpgroup (the default partition, ``num_warps = 4``) and PV warpgroup
    (``PV_REGS`` registers per thread) and a converter warpgroup (``CONVERTER_REGS``).

    Arguments otherwise as ``kernels_gluon.mla_split_ws_kernel``'s (grid: (head tiles of 64 rows,
    metadata rows - 1); scores in the log2 domain); ``PDL`` >= 1: the combine may launch as a
    programmatic dependent once every program has started; ``PREFETCH`` > 0: the converter asks L2
    for the rows of the tile that many ahead of the one it loads. ``PIPELINE`` = 1: the converter
    loads the next tile's rows group by group while it converts the current one (the tile carried
    across iterations as packed 32-bit words), instead of all of them before it waits for a slot.
    ``SKIP`` (timing only, results wrong): 1 leaves out the conversion and stores, 2 the loads, 3
    both (with PIPELINE: 2 only)."""
    gl.static_assert(BLOCK_N == 64, "K tiles of 64 tokens, the schedule's page")
    dtype: gl.constexpr = q_ptr.dtype.element_ty       # Q's and the RoPE part's (bf16)
    KDT: gl.constexpr = gl.float16                     # the codes' K tile, Q's 512-wide part and P
    if PDL >= 1:      # the combine (a dependent launch) may start its programs as these end
        _gdc_launch_dependents()
    # head tiles fastest: the tiles of one run start together and share the pages through L2
    pid_h, slot_first, slot_last = _program_run(meta_ptr, num_slots)
    if slot_first == slot_last:
        return
    # fp16 codes' K tiles, Q's 512-wide part and P; the RoPE parts in q's dtype (k_ready: the
    # converter's arrival; o_stored unused: no fused combine here)
    q_nope, q_rope, kn_ring, kr_ring, p_buf, alpha_buf, l_buf, k_ready, k_empty, sync = _ws_shared(
        KDT, dtype, K_SMEM, K_SMEM, K_SMEM, BLOCK_N, STAGES)

    # (argument tuples written out in the call: a tuple held in a variable loses its constexprs)
    gl.warp_specialize([
        (_ws_softmax, (q_ptr, q_nope, q_rope, kn_ring, kr_ring, p_buf, alpha_buf, l_buf, k_ready, k_empty,
                       sync.index(0), sync.index(1), sync.index(2), sync.index(3), sync.index(4), meta_ptr, splits_ptr,
                       seqlens_ptr, batch, num_slots, max_tokens, slot_first, slot_last, pid_h, h_q, s_q, qk_scale,
                       rows_total, out_ptr, lse_ptr, oacc_ptr, lseacc_ptr, stride_qb, stride_qs, stride_qh, stride_ob,
                       stride_os, stride_oh, stride_lb, stride_lh, CAUSAL, BLOCK_N, STAGES, 0, 0)),
        (_ws_pv, (kn_ring, p_buf, alpha_buf, l_buf, k_ready, k_empty, sync.index(0), sync.index(1),
                  sync.index(2), sync.index(3), sync.index(4), meta_ptr, splits_ptr, seqlens_ptr, batch, num_slots,
                  max_tokens, slot_first, slot_last, pid_h, h_q, rows_total, out_ptr, lse_ptr, oacc_ptr, lseacc_ptr,
                  seqlens_ptr, stride_ob, stride_os, stride_oh, stride_lb, stride_lh, BLOCK_N, STAGES, 0, BLOCK_H,
                  PDL)),
        (fp8_wide_converter, (cache_ptr, kn_ring, kr_ring, k_ready, k_empty, bt_ptr, stride_btb, meta_ptr, splits_ptr,
                              seqlens_ptr, batch, num_slots, max_tokens, num_blocks, slot_first, slot_last, BLOCK_N,
                              STAGES, KV_PAGE, PREFETCH, SKIP, PIPELINE)),
    ], [4, 4], [PV_REGS, CONVERTER_REGS])
