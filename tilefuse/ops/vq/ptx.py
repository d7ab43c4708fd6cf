"""PTX snippets of the resident-table VQ decode kernel (``kernels_resident.py``), generated per
constexpr variant. Plain Python, so ``tests/test_vq_ptx.py`` checks their logic on a CPU with a
lane-level emulator of the few PTX instructions they use.
"""


def lookup_asm(m_pad: int) -> str:
    """PTX for one code word (2 groups x 2 codebooks = 4 code bytes) -> M_PAD fp32 sums.

    Operands: outputs $0..$(M_PAD-1), then the word, then the lane's column offset in bytes
    (``4 * rho`` of the word's first group, < 256). ``prmt`` puts code byte j at bits 8-15 and the
    column offset at bits 0-7 in one instruction (a table row is 256 B), so each lookup is prmt,
    add of the table base (uniform: ptxas folds it into the shared load) and ``ld.shared``.
    Codebook 1's table is 64 KB further, the word's second group 32 columns (128 B) further."""
    vec = "" if m_pad == 1 else f".v{m_pad}"
    word, col = f"${m_pad}", f"${m_pad + 1}"

    def regs(name):
        inner = ", ".join(f"{name}{i}" for i in range(m_pad))
        return inner if m_pad == 1 else "{" + inner + "}"

    lines = [".reg .u32 a, b;", ".reg .f32 " + ", ".join(f"{n}{i}" for n in "pqrs" for i in range(m_pad)) + ";",
             "mov.u32 b, global_smem;"]
    for name, (byte, offset) in zip("pqrs", [(0, 0), (1, 65536), (2, 128), (3, 65664)]):
        lines += [f"prmt.b32 a, {word}, {col}, 0x76{byte}4;", "add.u32 a, a, b;",
                  f"ld.shared{vec}.f32 {regs(name)}, [a+{offset}];"]
    for i in range(m_pad):
        lines += [f"add.f32 p{i}, p{i}, q{i};", f"add.f32 r{i}, r{i}, s{i};", f"add.f32 ${i}, p{i}, r{i};"]
    return "{ " + " ".join(lines) + " }"


def reduce_emit_asm(rpt: int) -> tuple[str, str]:
    """PTX for the RPT rows a thread holds (one token, split-K): their 32 lanes' partials -> one
    ``red.global.add`` per row, by a transposed butterfly. Each halving step (xor 16, 8, ...) keeps
    half of the rows in each lane and sends the other half to the partner lane, so RPT rows cost
    RPT - 1 + 5 - log2(RPT) shuffles instead of 5 * RPT; then one lane per row (low lane bits zero)
    issues the atomic for its row, if that row is valid. Operands (``pack = RPT``): RPT dummy
    outputs, then the RPT partials, the RPT workspace addresses and the RPT row-valid flags."""
    n = rpt
    v = [f"${n + i}" for i in range(n)]
    a = [f"${2 * n + i}" for i in range(n)]
    ok = [f"${3 * n + i}" for i in range(n)]
    assert n in (2, 4, 8), "rows per thread: 2, 4 or 8"
    half_n = n // 2
    lines = [".reg .u32 l, t;", ".reg .pred p, q;", ".reg .f32 s, y;",
             ".reg .f32 " + ", ".join(f"x{k}" for k in range(half_n)) + ";",
             ".reg .u64 " + ", ".join(f"d{k}" for k in range(half_n)) + ";",
             ".reg .u32 " + ", ".join(f"o{k}" for k in range(half_n)) + ";",
             "mov.u32 l, %laneid;"]
    vals, adrs, oks, mask = v, a, ok, 16
    while len(vals) > 1:
        half = len(vals) // 2
        lines += [f"and.b32 t, l, {mask};", "setp.ne.u32 p, t, 0;"]
        for k in range(half):
            lo, hi = vals[k], vals[k + half]
            lines += [f"selp.f32 s, {lo}, {hi}, p;", f"selp.f32 x{k}, {hi}, {lo}, p;",
                      f"shfl.sync.bfly.b32 y, s, {mask}, 31, -1;", f"add.f32 x{k}, x{k}, y;",
                      f"selp.b64 d{k}, {adrs[k + half]}, {adrs[k]}, p;",
                      f"selp.b32 o{k}, {oks[k + half]}, {oks[k]}, p;"]
        vals, adrs, oks = [f"x{k}" for k in range(half)], [f"d{k}" for k in range(half)], [f"o{k}" for k in range(half)]
        mask //= 2
    while mask >= 1:
        lines += [f"shfl.sync.bfly.b32 y, x0, {mask}, 31, -1;", "add.f32 x0, x0, y;"]
        mask //= 2
    low = 32 // n - 1
    lines += [f"and.b32 t, l, {low};", "setp.eq.u32 p, t, 0;", "setp.ne.u32 q, o0, 0;", "and.pred p, p, q;",
              "@p red.global.add.f32 [d0], x0;"]
    lines += [f"mov.u32 ${i}, 0;" for i in range(n)]
    constraints = ",".join(["=r"] * n + ["f"] * n + ["l"] * n + ["r"] * n)
    return "{ " + " ".join(lines) + " }", constraints


def dequant_asm(kind: str) -> str:
    """PTX for one group of the MMA decode kernel (``kernels_mma.py``): 8 weights ``C0[a] + C1[b]``.

    Operands (``pack = 8``): outputs $0..$3 (the 8 values as 4 packed 16-bit pairs), then 8 copies
    of the byte offset of C0[a]'s copy for this lane, then 8 of C1[b]'s (only the first of each is
    read). Codebook 1 starts 32 KB after codebook 0 in ``global_smem``. One rounding to ``kind``
    ("f16": ``add.rn.f16x2``; "bf16": ``fma.rn.bf16x2`` with 1.0, which sm_80 has too)."""
    add = {"f16": "add.rn.f16x2 $%d, p%d, q%d;", "bf16": "fma.rn.bf16x2 $%d, p%d, one, q%d;"}[kind]
    lines = [".reg .u32 a, b, base;", ".reg .b32 one, p<4>, q<4>;", "mov.u32 base, global_smem;",
             "mov.b32 one, 0x3F803F80;", "add.u32 a, $4, base;", "add.u32 b, $12, base;",
             "ld.shared.v4.b32 {p0, p1, p2, p3}, [a];", "ld.shared.v4.b32 {q0, q1, q2, q3}, [b+32768];"]
    lines += [add % (i, i, i) for i in range(4)]
    return "{ " + " ".join(lines) + " }"


def pair_dequant_asm(kind: str, base: int = 0) -> str:
    """PTX for one weight pair of the prefill kernel (``kernels_prefill.py``): ``C0[a] + C1[b]`` at
    two consecutive positions of a group, packed in one 32-bit register.

    The codebook copies are interleaved, 256 bytes per code: ``[code, codebook, copy, 8 values]``
    (``base`` bytes into ``global_smem``), so a lookup's byte offset is ``code * 256 + codebook * 128
    + lane offset`` and one ``prmt`` builds it: the code byte (low byte of the code pair for
    codebook 0, the next for codebook 1) into byte 1, the lane's offset (``copy * 16 + pair * 4``,
    < 128) into byte 0, a zero byte of it above; the codebook's 128 and ``base`` fold into the
    loads. Operands (``pack = 2``): output $0, then 2 copies of the code pair, then 2 of the lane
    offset (only the first of each is read). One rounding to ``kind`` as :func:`dequant_asm`."""
    add = {"f16": ["add.rn.f16x2 $0, p, q;"], "bf16": ["mov.b32 one, 0x3F803F80;", "fma.rn.bf16x2 $0, p, one, q;"]}
    lines = [".reg .u32 a, b, base;", ".reg .b32 one, p, q;", "mov.u32 base, global_smem;",
             "prmt.b32 a, $1, $3, 0x5504;", "prmt.b32 b, $1, $3, 0x5514;", "add.u32 a, a, base;",
             "add.u32 b, b, base;", f"ld.shared.b32 p, [a+{base}];", f"ld.shared.b32 q, [b+{base + 128}];",
             *add[kind]]
    return "{ " + " ".join(lines) + " }"
