"""Gluon twin of :func:`tilefuse.ops.vq.kernels.vq_decode_kernel` (GPU only, Hopper/Ampere MMA).

Why Gluon: Triton 3.6's ``tl`` pipeline rewrites every ``tl.gather`` into a warp-local layout
(OptimizeThreadLocality), i.e. 8 shuffles + 8 selects per lookup for a 256-entry table. Gluon
skips that pass and lets us pin the layouts, so ``gl.gather`` lowers to: store the table to
shared memory, barrier, one ``ld.shared`` per lookup. With the lookup tile in layout ``L_COL``
(lane i of a warp owns table column i) the address of a lookup is ``code * COLS + column``, so the
32 lanes of a warp hit 32 different banks whatever the codes are: EVA's conflict-free table.

Per K step and program: 2 tensor-core MMAs build the tables (``[256, 16] x [16, COLS]``, fp32),
the tables move MMA layout -> ``L_COL`` (the gather then stores them bank-conflict free), codes of
``BLOCK_N`` rows stream from HBM as one int16 per (row, group), and every code costs one shared
load and one add. The table build is amortised over ``BLOCK_N`` rows (cost ratio ~256/BLOCK_N),
which is why ``BLOCK_N`` is large. The split-K epilogue is the same as the ``tl`` kernel's.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2


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
    # lookup tiles [BLOCK_N, COLS]: lanes along the table columns (one bank each), warps along rows
    L_COL: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [NUM_WARPS, 1], [1, 0])
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    L_A: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [NUM_WARPS, 1], [1, 0])
    L_B: gl.constexpr = gl.BlockedLayout([8, 1], [2, 16], [1, NUM_WARPS], [0, 1])
    dtype: gl.constexpr = x_ptr.dtype.element_ty

    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    g_begin = pid_k * GROUPS_PER_SPLIT
    g_end = gl.minimum(g_begin + GROUPS_PER_SPLIT, NUM_GROUPS)

    # A = [C0 | C1] as [256, 16] (HBM -> registers once, in the MMA operand layout)
    offs_e = gl.arange(0, 256, layout=gl.SliceLayout(1, L_A))
    offs_ka = gl.arange(0, 16, layout=gl.SliceLayout(0, L_A))
    a = gl.load(cb_ptr + (offs_ka[None, :] // 8) * 2048 + offs_e[:, None] * 8 + (offs_ka[None, :] % 8))
    a = gl.convert_layout(a.to(dtype), A_OP)

    rows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_COL))
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, L_COL))
    col_tok = cols // GM
    col_grp = cols % GM
    row_ok = rows[:, None] < N
    b_k = gl.arange(0, 16, layout=gl.SliceLayout(1, L_B))[:, None]
    b_cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, L_B))[None, :]
    b_tok = b_cols // GM
    b_grp = b_cols % GM
    zero_t = gl.zeros([256, COLS], gl.float32, MMA)
    acc = gl.zeros([BLOCK_N, COLS], gl.float32, L_COL)
    # codes of the first K step; inside the loop the next step's codes are requested before the
    # current step's tables are built, so the HBM latency hides behind the MMAs and lookups
    col_ok = row_ok & ((g_begin + col_grp[None, :]) < g_end)
    c_ptrs = codes_ptr + rows[:, None] * stride_cn + (g_begin + col_grp[None, :])
    cv = gl.load(c_ptrs, mask=col_ok, other=0)
    for g0 in range(g_begin, g_end, GM):
        nxt_ok = row_ok & ((g0 + GM + col_grp[None, :]) < g_end)
        cv_next = gl.load(c_ptrs + (g0 + GM - g_begin), mask=nxt_ok, other=0)
        # x of this K step -> the two B operands (codebook 0 uses k < 8, codebook 1 k >= 8)
        grp = g0 + b_grp
        xv = gl.load(x_ptr + b_tok * stride_xm + grp * 8 + (b_k % 8), mask=(b_tok < M) & (grp < g_end), other=0.0)
        b0 = gl.convert_layout(gl.where(b_k < 8, xv, gl.zeros_like(xv)), B_OP)
        b1 = gl.convert_layout(gl.where(b_k >= 8, xv, gl.zeros_like(xv)), B_OP)
        # lookups through shared memory, bank = column: conflict-free. Masked codes read entry 0
        # of a column whose x was masked to zero, so they add nothing.
        # CONVERT_TABLE: move the table to L_COL first (conflict-free gather stores, one more smem
        # round trip) or let the gather store it straight from the MMA layout (8-way conflicts)
        t0 = mma_v2(a, b0, zero_t)
        t1 = mma_v2(a, b1, zero_t)
        if CONVERT_TABLE:
            t0 = gl.convert_layout(t0, L_COL)
            t1 = gl.convert_layout(t1, L_COL)
        acc += gl.gather(t0, (cv & 0xFF).to(gl.int32), 0)
        acc += gl.gather(t1, ((cv >> 8) & 0xFF).to(gl.int32), 0)
        cv = cv_next

    scale = gl.load(scales_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)
    toks = gl.arange(0, M_PAD, layout=gl.SliceLayout(0, L_COL))
    part = gl.zeros([BLOCK_N, M_PAD], gl.float32, L_COL)
    for m in gl.static_range(M_PAD):
        s = gl.sum(gl.where(col_tok[None, :] == m, acc, gl.zeros_like(acc)), axis=1)
        part = gl.where(toks[None, :] == m, s[:, None] + gl.zeros_like(part), part)
    part = part * scale[:, None]

    # split-K epilogue (same protocol as kernels._splitk_epilogue)
    mask = (rows[:, None] < N) & (toks[None, :] < M)
    if not SPLIT:  # one program per row block: no workspace
        total = part
    else:
        ws_ptrs = ws_ptr + toks[None, :] * N + rows[:, None]
        gl.atomic_add(ws_ptrs, part, mask=mask, sem="relaxed")
        gl.thread_barrier()
        arrived = gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        total = gl.zeros_like(part)
        if arrived == SPLIT_K - 1:
            # read the sums where the atomics landed (L2), then leave zeros for the next call
            total = gl.atomic_add(ws_ptrs, gl.zeros_like(part), mask=mask, sem="relaxed")
            gl.store(ws_ptrs, gl.zeros_like(part), mask=mask)
            gl.store(cnt_ptr + pid_n, 0)
        mask = mask & (arrived == SPLIT_K - 1)
    if HAS_BIAS:
        bias = gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)
        total = total + bias[:, None]
    gl.store(out_ptr + toks[None, :] * stride_om + rows[:, None], total.to(out_ptr.dtype.element_ty), mask=mask)
