"""Compile a Gluon (or ``tl``) kernel for sm_90a on a machine without a GPU: compile errors, shared memory,
registers and spills, and the PTX (Triton's wheel ships ptxas). The CPU tests use it to check the
Hopper kernels' resources; by hand it shows what a change does before any device time is spent::

    from tilefuse.testing.gluon import compile_gluon, tensordesc
    from tilefuse.ops.vq.kernels_resident import vq_decode_resident_kernel
    result = compile_gluon(kernel, {"x_ptr": "*bf16", "N": "i32", "BLOCK": "constexpr"},
                           {"BLOCK": 128}, num_warps=8, aligned=["x_ptr", "N"])
    result.shared, result.registers, result.spilled, result.ptx

``aligned`` names the arguments to specialize as divisible by 16 (pointers: 16-byte aligned), as the
JIT does at launch when the values are, so that the vectorization matches the real launch.
:func:`tensordesc` gives the signature type of a host TMA descriptor argument. The cubin can be
kept (``cubin=path``) and disassembled with ``nvdisasm`` to count instructions per loop.

A process that imported Triton with ``TRITON_INTERPRET=1`` (the CPU tests) cannot compile Gluon
kernels that reduce (``gl.max``, ``gl.sum``: their combine functions were made interpreter-only at
import); :func:`compile_gluon_isolated` compiles in a fresh interpreter-free process instead.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile


@dataclasses.dataclass
class Compiled:
    ptx: str
    shared: int             # bytes of shared memory per program
    registers: int          # per thread, from ptxas
    spilled: int            # spill store + spill load bytes, from ptxas
    ptxas: list[str]        # ptxas's resource lines
    kernel: object = None   # triton's CompiledKernel (``.asm``, ``.metadata``); None when isolated


def tensordesc(dtype, block: list[int]) -> str:
    """Signature type of a host ``TensorDescriptor`` argument over ``dtype`` (torch) elements in
    ``block`` boxes, with the default NVMMA shared layout (what the ops build)."""
    import torch
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32,
               torch.float8_e4m3fn: gl.float8e4nv, torch.int16: gl.int16}[dtype]
    probe = torch.empty(1, dtype=dtype)
    shape = [16 * b for b in block]
    strides = [1] * len(block)
    for d in range(len(block) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return mangle_type(TensorDescriptor(probe, shape, strides, list(block),
                                        gl.NVMMASharedLayout.get_default_for(list(block), element)))


def compile_gluon(fn, signature: dict, constexprs: dict, num_warps: int, aligned=(), cubin: str | None = None,
                  num_stages: int | None = None) -> Compiled:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource

    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    # a Gluon kernel, or a ``tl`` one (``@triton.jit``: the same compile, Triton's own front end)
    source = GluonASTSource if "gluon" in type(fn).__module__ else triton.compiler.ASTSource
    src = source(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps} if num_stages is None else {"num_warps": num_warps, "num_stages": num_stages}
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        ptxas = get_ptxas(90).path       # the ptxas Triton itself uses for sm_90 (3.9: its CUDA 13 one)
        result = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", cubin or os.path.join(tmp, "kernel.cubin")],
                                capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"ptxas failed: {result.stderr}")
    lines = [line.strip() for line in result.stderr.splitlines() if "Used" in line or "spill" in line]
    registers = sum(int(n) for n in re.findall(r"Used (\d+) registers", " ".join(lines)))
    spilled = sum(int(n) for n in re.findall(r"(\d+) bytes spill", " ".join(lines)))
    return Compiled(compiled.asm["ptx"], compiled.metadata.shared, registers, spilled, lines, compiled)


def _smem_offset(ptx: str, reg: str, depth: int = 0) -> int | None:
    """Constant byte offset of PTX register ``reg`` from ``global_smem``, following the chain of
    ``mov``/``add`` instructions that defines it (None where it does not derive from it)."""
    if depth > 32:
        return None
    found = re.search(rf"^\s*(mov|add)\.[us]?b?\d+\s+{re.escape(reg)},\s*([^;]+);", ptx, re.M)
    if not found:
        return None
    op, args = found.group(1), [a.strip() for a in found.group(2).split(",")]
    if op == "mov":
        return 0 if args[0] == "global_smem" else (_smem_offset(ptx, args[0], depth + 1)
                                                    if args[0].startswith("%r") else None)
    offsets = [o for a in args if a.startswith("%r") for o in [_smem_offset(ptx, a, depth + 1)] if o is not None]
    constants = [int(a) for a in args if re.fullmatch(r"-?\d+", a)]
    return offsets[0] + sum(constants) if len(offsets) == 1 else None


def first_shared_store_offset(ptx: str) -> int | None:
    """Byte offset in ``global_smem`` (the start of the program's shared memory) of the first
    shared store of thread 0 in ``ptx``, whether Triton writes it as ``[%r+imm]`` (3.6,
    3.9) or as an ``add`` of ``global_smem`` and a register (3.7, 3.8). Kernels whose inline PTX
    addresses ``global_smem`` directly use it to check where Triton's allocator put a buffer."""
    store = re.search(r"st\.shared(?:::cta)?(?:\.v\d)?\.[bfu]\d+\s+\[\s*(%r\d+)\s*(?:\+\s*(\d+)\s*)?\]", ptx)
    if store is None:
        return None
    base = _smem_offset(ptx, store.group(1))
    return None if base is None else base + int(store.group(2) or 0)


def compile_gluon_isolated(kernel: str, signature: dict, constexprs: dict, num_warps: int, aligned=(),
                           num_stages: int | None = None) -> Compiled:
    """:func:`compile_gluon` of ``kernel`` (``"package.module:function"``) in a child process
    with ``TRITON_INTERPRET=0``; arguments JSON-serializable (``num_stages``: a ``tl`` kernel's
    pipeline depth as its launch sets it; Triton's default without).

    A failure in the child is raised here with the child's own exception (type, message and the
    innermost frames of its traceback), not the tail of its stderr, which Triton's bindings fill
    with ``nanobind: leaked ...`` lines at exit."""
    spec = dict(kernel=kernel, signature=signature, constexprs=constexprs, num_warps=num_warps, aligned=list(aligned),
                num_stages=num_stages)
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-m", "tilefuse.testing.gluon"], input=json.dumps(spec), env=env,
                          capture_output=True, text=True)
    try:
        reply = json.loads(done.stdout)
    except json.JSONDecodeError:
        reply = None
    if isinstance(reply, dict) and "error" in reply:
        raise RuntimeError(f"compiling {kernel} failed in the child process:\n{reply['error']}")
    if done.returncode or reply is None:
        stderr = "\n".join(line for line in done.stderr.splitlines() if "nanobind: leaked" not in line)
        raise RuntimeError(f"compiling {kernel}: the child process exited with {done.returncode}:\n"
                           f"{stderr[-4000:]}")
    return Compiled(**reply)


def _main() -> None:
    import traceback

    spec = json.load(sys.stdin)
    try:
        module, name = spec["kernel"].split(":")
        result = compile_gluon(getattr(importlib.import_module(module), name), spec["signature"],
                               spec["constexprs"], spec["num_warps"], spec["aligned"],
                               num_stages=spec.get("num_stages"))
    except Exception as exc:  # reported to the parent as data: its stderr is not a reliable channel
        frames = "".join(traceback.format_tb(exc.__traceback__)[-6:])
        json.dump({"error": f"{frames}{type(exc).__name__}: {exc}"}, sys.stdout)
        return
    json.dump({f.name: getattr(result, f.name) for f in dataclasses.fields(result) if f.name != "kernel"}, sys.stdout)


if __name__ == "__main__":
    _main()
