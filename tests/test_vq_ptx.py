"""The inline PTX of the VQ kernels (``tilefuse.ops.vq.ptx``), checked on the CPU.

A lane-level emulator runs the few PTX instructions the snippets use over the 32 lanes of a warp:
the resident decode's lookups must read the table entries the layout says (and hit 32 distinct banks
per shared-memory wavefront whatever the codes), its transposed butterfly must emit each valid row's
sum exactly once, and the prefill kernel's weight-pair lookups must read the codebook copies its
lane mapping says, conflict free. The GPU tests then check the whole kernels against the fp64
reference.
"""

import random
import re

import pytest

from tilefuse.ops.vq.ptx import lookup_asm, pair_dequant_asm, reduce_emit_asm

SMEM_BASE = 0x400  # any 256-aligned shared address of the table


def run_warp(asm, operands, memory=None):
    """Execute ``asm`` on 32 lanes; ``operands[lane]`` maps "$k" to its value. Returns per-lane
    registers, the shared loads ([(lanes, addresses, bytes)] per instruction) and the reds."""
    body = [i.strip() for i in asm.strip("{} ").split(";") if i.strip() and not i.strip().startswith(".reg")]
    regs = [dict(ops) for ops in operands]
    loads, reds = [], []

    def val(lane, x):
        if x == "%laneid":
            return lane
        if x == "global_smem":
            return SMEM_BASE
        return int(x, 0) if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", x) else regs[lane][x]

    for ins in body:
        pred = None
        if ins.startswith("@"):
            pred, ins = ins[1:].split(" ", 1)
        op, args = ins.split(" ", 1)
        args = [a.strip() for a in re.split(r",(?![^{]*})", args)]
        if op == "shfl.sync.bfly.b32":
            src = [regs[lane ^ int(args[2])][args[1]] if args[1] in regs[lane ^ int(args[2])] else val(lane ^ int(args[2]), args[1]) for lane in range(32)]
            for lane in range(32):
                regs[lane][args[0]] = src[lane]
            continue
        if op.startswith("ld.shared"):
            width = int(op.split(".v")[1].split(".")[0]) if ".v" in op else 1
            base, off = args[1].strip("[]").split("+")
            addrs = [val(lane, base) + int(off) for lane in range(32)]
            loads.append((addrs, 4 * width))
            for lane in range(32):
                dests = args[0].strip("{}").replace(" ", "").split(",")
                for i, d in enumerate(dests):
                    regs[lane][d] = memory[addrs[lane] + 4 * i]
            continue
        for lane in range(32):
            r = regs[lane]
            if pred is not None and not r[pred]:
                continue
            if op == "red.global.add.f32":
                reds.append((val(lane, args[0].strip("[]")), val(lane, args[1])))
            elif op in ("add.rn.f16x2", "fma.rn.bf16x2"):  # packed pairs as tuples; fma's multiplier is 1.0
                a, b = val(lane, args[1]), val(lane, args[-1])
                if op.startswith("fma"):
                    assert val(lane, args[2]) == 0x3F803F80
                r[args[0]] = (a[0] + b[0], a[1] + b[1])
            elif op in ("mov.u32", "mov.f32", "mov.b64", "mov.b32"):
                r[args[0]] = val(lane, args[1])
            elif op in ("add.u32",):
                r[args[0]] = (val(lane, args[1]) + val(lane, args[2])) & 0xFFFFFFFF
            elif op == "add.f32":
                r[args[0]] = val(lane, args[1]) + val(lane, args[2])
            elif op == "and.b32":
                r[args[0]] = val(lane, args[1]) & val(lane, args[2])
            elif op in ("setp.ne.u32", "setp.eq.u32"):
                r[args[0]] = (val(lane, args[1]) != val(lane, args[2])) == (op == "setp.ne.u32")
            elif op == "and.pred":
                r[args[0]] = r[args[1]] and r[args[2]]
            elif op.startswith("selp"):
                r[args[0]] = val(lane, args[1]) if r[args[3]] else val(lane, args[2])
            elif op == "prmt.b32":  # default mode, selector nibbles < 8
                pool = [(val(lane, args[1]) >> (8 * i)) & 0xFF for i in range(4)]
                pool += [(val(lane, args[2]) >> (8 * i)) & 0xFF for i in range(4)]
                sel = val(lane, args[3])
                r[args[0]] = sum(pool[(sel >> (4 * i)) & 0x7] << (8 * i) for i in range(4))
            else:
                raise NotImplementedError(op)
    return regs, loads, reds


@pytest.mark.parametrize("m_pad", [1, 2, 4])
def test_lookup_reads_the_layouts_entries_without_bank_conflicts(m_pad):
    rnd = random.Random(m_pad)
    table = {(cb, c, rho): rnd.uniform(-1, 1) for cb in range(2) for c in range(256) for rho in range(64)}
    memory = {SMEM_BASE + cb * 65536 + c * 256 + rho * 4: v for (cb, c, rho), v in table.items()}
    words_per_row = 32 // m_pad  # W = G / 2 lanes per row; 32 / W rows per warp
    lane_word = [lane % words_per_row for lane in range(32)]
    codes = [[rnd.randrange(256) for _ in range(4)] for _ in range(32)]
    operands = [{f"${m_pad}": sum(b << (8 * i) for i, b in enumerate(codes[lane])),
                 f"${m_pad + 1}": lane_word[lane] * 4 * m_pad} for lane in range(32)]
    regs, loads, _ = run_warp(lookup_asm(m_pad), operands, memory)
    for lane in range(32):
        w, (c0, c1, c2, c3) = lane_word[lane], codes[lane]
        for m in range(m_pad):
            rho0, rho1 = w * m_pad + m, 32 + w * m_pad + m  # groups 2w and 2w + 1
            want = table[0, c0, rho0] + table[1, c1, rho0] + table[0, c2, rho1] + table[1, c3, rho1]
            assert regs[lane][f"${m}"] == pytest.approx(want, rel=1e-12)
    # a 128-byte wavefront serves 128 / bytes-per-lane lanes; those must hit 32 distinct banks
    for addrs, nbytes in loads:
        per_wave = 128 // nbytes
        for first in range(0, 32, per_wave):
            banks = [(a // 4 + i) % 32 for a in addrs[first:first + per_wave] for i in range(nbytes // 4)]
            assert len(set(banks)) == 32, (nbytes, banks)


@pytest.mark.parametrize("rpt", [2, 4, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_transposed_butterfly_emits_each_valid_row_once(rpt, seed):
    rnd = random.Random(seed)
    partial = [[rnd.uniform(-1, 1) for _ in range(rpt)] for _ in range(32)]  # [lane][row i]
    valid = [rnd.random() < 0.7 for _ in range(rpt)]
    addr = [1000 + 64 * i for i in range(rpt)]
    asm, constraints = reduce_emit_asm(rpt)
    assert constraints.count("=r") == rpt and constraints.count("l") == rpt
    operands = [{**{f"${rpt + i}": partial[lane][i] for i in range(rpt)},
                 **{f"${2 * rpt + i}": addr[i] for i in range(rpt)},
                 **{f"${3 * rpt + i}": int(valid[i]) for i in range(rpt)}} for lane in range(32)]
    _, _, reds = run_warp(asm, operands)
    for i in range(rpt):
        got = [v for a, v in reds if a == addr[i]]
        if valid[i]:
            assert len(got) == 1 and got[0] == pytest.approx(sum(p[i] for p in partial), rel=1e-12)
        else:
            assert not got
    assert len(reds) == sum(valid)


@pytest.mark.parametrize("kind,base", [("f16", 0), ("bf16", 98304)])
def test_prefill_pair_lookup_reads_its_copies_without_bank_conflicts(kind, base):
    """Lane 4r + t of the prefill kernel's A operand holds weight pair t of a group of row r (mod 8)
    and reads copy r of both entries (interleaved copies, 256 bytes per code): C0[a] + C1[b] at
    positions 2t, 2t + 1, on 32 distinct banks."""
    rnd = random.Random(base)
    books = [[[rnd.uniform(-1, 1) for _ in range(8)] for _ in range(256)] for _ in range(2)]
    memory = {SMEM_BASE + base + e * 256 + j * 128 + c * 16 + t * 4: (books[j][e][2 * t], books[j][e][2 * t + 1])
              for j in range(2) for e in range(256) for c in range(8) for t in range(4)}
    codes = [(rnd.randrange(256), rnd.randrange(256)) for _ in range(8)]         # per row r
    operands = []
    for lane in range(32):
        r, t = lane // 4, lane % 4
        a, b = codes[r]
        pair = a | b << 8 | (0xFFFF0000 if b >= 128 else 0)   # the int16 pair, sign-extended
        operands.append({"$1": pair, "$2": 0, "$3": r * 16 + t * 4, "$4": 0})
    regs, loads, _ = run_warp(pair_dequant_asm(kind, base), operands, memory)
    for lane in range(32):
        r, t = lane // 4, lane % 4
        a, b = codes[r]
        want = [books[0][a][2 * t + i] + books[1][b][2 * t + i] for i in range(2)]
        assert regs[lane]["$0"] == pytest.approx(want, rel=1e-12)
    assert len(loads) == 2
    for addrs, nbytes in loads:
        assert nbytes == 4 and len({(a // 4) % 32 for a in addrs}) == 32
