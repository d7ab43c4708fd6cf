"""Gluon twin of :func:`tilefuse.ops.vq.kernels.vq_decode_kernel` (GPU only, MMA v2 on sm_80+).

The decode kernel for K/8 odd (the resident kernel reads codes as int32 words, two groups each)
and for 5-8 tokens when the decode variant is forced; 1-4 tokens with K/8 even run the faster
shared-memory-resident table kernel in ``kernels_resident.py``. Codebooks are rounded to x's
dtype here (they are an MMA operand).

Why Gluon: Triton 3.6's ``tl`` pipeline rewrites every ``tl.gather`` into a warp-local layout
(OptimizeThreadLocality), i.e. 8 shuffles + 8 selects per lookup for a 256-entry table. Gluon
skips that pass and lets us pin the layouts, so ``gl.gather`` lowers to: store the table to
shared memory, barrier, one ``ld.shared`` per lookup.

Bank layout: the gather scratch is linearized with dimension 0 fastest (``LLVM::linearize``), so
the table is held TRANSPOSED, ``T[col, e]`` of shape ``[COLS, 256]``, gathered along axis 1: a
lookup reads word ``e * COLS + col``. With ``COLS = 32`` and lane ``i`` of a warp owning table
column ``i`` (layouts ``L_TAB`` / ``L_IDX`` below), the 32 lanes hit 32 different banks whatever
the codes are (EVA's conflict-free table), and the table stores are conflict-free too.

Per K step and program: 2 tensor-core MMAs build the tables (``[COLS, 16] x [16, 256]``, fp32,
rows = (token, group) columns, B = both codebooks transposed, kept in registers), codes of
``BLOCK_N`` rows stream from HBM as one int16 per (row, group) (the next step's codes are
requested before this step's tables are built), and every code costs one shared load and one add.
The table build is amortised over ``BLOCK_N`` rows. The split-K epilogue is the same protocol as
the ``tl`` kernel's.

Measured on the H200 (batch 1, the full VQ bench of commit 3fefb9e): 20 us at 4096x4096 (cuBLAS fp16 19),
81 us at 28672x8192 (cuBLAS 122, memory floor 13.8). Where the rest goes (roofline reasoning, not
profiled per stage): per K step a program moves ~3 x 64 KB of table through shared memory (two
fp32 tables, stored by the layout conversion, reloaded, stored again by the gather) against
2 x 32 KB of lookups for 256 rows, every phase separated by a CTA barrier, and 255 registers
allow one 8-warp CTA per SM, so nothing overlaps the barriers. The first version held the table
as ``[256, COLS]``: with the dim-0-fastest scratch that was a 32-way bank conflict on every table
store and random conflicts on lookups (376 us at 28672x8192).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from tilefuse.ops.gluon_compat import thread_barrier


@gluon.jit
def vq_decode_gluon_kernel(
    # pointers
    x_ptr, codes_ptr, cb_ptr, scales_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    # sizes
    M, N, NUM_GROUPS, GROUPS_PER_SPLIT, SPLIT_K,
    # strides
    stride_xm, stride_cn, stride_om,
    # meta-parameters
    BLOCK_N: gl.constexpr, COLS: gl.constexpr, M_PAD: gl.constexpr,
    SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, NUM_WARPS: gl.constexpr,
    CONVERT_TABLE: gl.constexpr = True,
):
    GM: gl.constexpr = COLS // M_PAD
    # MMA over [COLS, 256]: warps split the 256 entries, each warp 8-entry column strips
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NUM_WARPS], instr_shape=[16, 8])
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    # table [COLS, 256]: lane = column, 8 consecutive entries per thread (same warp strips as MMA)
    L_TAB: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [1, NUM_WARPS], [0, 1])
    # lookup tiles [COLS, BLOCK_N]: lane = table column (= bank), warps over rows
    L_IDX: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, NUM_WARPS], [0, 1])
    L_X: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [1, NUM_WARPS], [1, 0])
    L_B: gl.constexpr = gl.BlockedLayout([8, 1], [1, 32], [1, NUM_WARPS], [0, 1])
    ROWS: gl.constexpr = gl.SliceLayout(0, L_IDX)
    dtype: gl.constexpr = x_ptr.dtype.element_ty

    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    g_begin = pid_k * GROUPS_PER_SPLIT
    g_end = gl.minimum(g_begin + GROUPS_PER_SPLIT, NUM_GROUPS)

    # B_c = codebook c transposed on its half of k, zero on the other: [16, 256] each (HBM ->
    # registers once, MMA operand layout). The zeros sit in B, not in A, so a NaN in an entry of
    # one codebook never reaches the other codebook's table (0 x NaN), and A is x in both halves.
    bk = gl.arange(0, 16, layout=gl.SliceLayout(1, L_B))[:, None]
    be = gl.arange(0, 256, layout=gl.SliceLayout(0, L_B))[None, :]
    b = gl.load(cb_ptr + (bk // 8) * 2048 + be * 8 + (bk % 8)).to(dtype)
    b0 = gl.convert_layout(gl.where(bk < 8, b, gl.zeros_like(b)), B_OP)
    b1 = gl.convert_layout(gl.where(bk >= 8, b, gl.zeros_like(b)), B_OP)

    rows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=ROWS)
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(1, L_IDX))
    col_grp = cols[:, None] % GM
    row_ok = rows[None, :] < N
    xc = gl.arange(0, COLS, layout=gl.SliceLayout(1, L_X))[:, None]
    xk = gl.arange(0, 16, layout=gl.SliceLayout(0, L_X))[None, :]
    x_tok = xc // GM
    x_grp = xc % GM
    zero_t = gl.zeros([COLS, 256], gl.float32, MMA)
    acc = gl.zeros([COLS, BLOCK_N], gl.float32, L_IDX)

    c_ptrs = codes_ptr + rows[None, :] * stride_cn + (g_begin + col_grp)
    cv = gl.load(c_ptrs, mask=row_ok & ((g_begin + col_grp) < g_end), other=0)
    for g0 in range(g_begin, g_end, GM):
        # next step's codes first (HBM latency hides behind this step's MMAs and lookups)
        cv_next = gl.load(c_ptrs + (g0 + GM - g_begin), mask=row_ok & ((g0 + GM + col_grp) < g_end), other=0)
        # A[(m, g), k] = x[m, 8(g0+g) + k % 8]: the group's 8 inputs in both halves of k
        grp = g0 + x_grp
        xv = gl.load(x_ptr + x_tok * stride_xm + grp * 8 + (xk % 8), mask=(x_tok < M) & (grp < g_end), other=0.0)
        a = gl.convert_layout(xv, A_OP)
        # one codebook at a time (fewer live registers). CONVERT_TABLE: lane = column before the
        # gather stores the table (no bank conflicts; else 4-way conflicts from the MMA layout).
        # Masked codes read entry 0 of a column whose x was masked to zero: they add nothing.
        t0 = mma_v2(a, b0, zero_t)
        if CONVERT_TABLE:
            t0 = gl.convert_layout(t0, L_TAB)
        acc += gl.gather(t0, (cv & 0xFF).to(gl.int32), 1)
        t1 = mma_v2(a, b1, zero_t)
        if CONVERT_TABLE:
            t1 = gl.convert_layout(t1, L_TAB)
        acc += gl.gather(t1, ((cv >> 8) & 0xFF).to(gl.int32), 1)
        cv = cv_next

    # per-token sums over the token's GM columns; the row scale factors out of the sum
    scale = gl.load(scales_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)
    if HAS_BIAS:
        bias = gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)
    col_tok = cols[:, None] // GM
    if not SPLIT:  # one program per row block: no workspace
        for m in gl.static_range(M_PAD):
            s = gl.sum(gl.where(col_tok == m, acc, gl.zeros_like(acc)), axis=0) * scale
            if HAS_BIAS:
                s += bias
            gl.store(out_ptr + m * stride_om + rows, s.to(out_ptr.dtype.element_ty), mask=(rows < N) & (m < M))
    else:
        # split-K: fp32 atomics into the workspace, arrival counter, the last program finishes
        for m in gl.static_range(M_PAD):
            s = gl.sum(gl.where(col_tok == m, acc, gl.zeros_like(acc)), axis=0) * scale
            gl.atomic_add(ws_ptr + m * N + rows, s, mask=(rows < N) & (m < M), sem="relaxed")
        thread_barrier()
        arrived = gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            for m in gl.static_range(M_PAD):
                ok = (rows < N) & (m < M)
                # read the sums where the atomics landed (L2), then leave zeros for the next call
                total = gl.atomic_add(ws_ptr + m * N + rows, gl.zeros_like(scale), mask=ok, sem="relaxed")
                gl.store(ws_ptr + m * N + rows, gl.zeros_like(scale), mask=ok)
                if HAS_BIAS:
                    total += bias
                gl.store(out_ptr + m * stride_om + rows, total.to(out_ptr.dtype.element_ty), mask=ok)
            gl.store(cnt_ptr + pid_n, 0)
