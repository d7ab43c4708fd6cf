"""Compile a Gluon kernel for sm_90 on a CPU-only machine: compile errors, shared memory,
registers and spills, and the PTX, without a GPU (Triton's wheel ships ptxas).

Use it from Python with ``tools/`` on ``sys.path`` (e.g. ``PYTHONPATH=tools python3``)::

    from gluon_compile import compile_gluon
    from tilefuse.ops.vq.kernels_resident import vq_decode_resident_kernel
    compiled, ptxas = compile_gluon(kernel, {"x_ptr": "*bf16", "N": "i32", "BLOCK": "constexpr"},
                                    {"BLOCK": 128}, num_warps=8, aligned=["x_ptr", "N"])
    compiled.metadata.shared, compiled.asm["ptx"], ptxas   # ptxas: "Used 128 registers, ..."

``aligned`` names the arguments to specialize as divisible by 16 (pointers: 16-byte aligned), as the
JIT does at launch when the values are, so that the vectorization matches the real launch. The
cubin it writes can be disassembled with ``nvdisasm`` to count instructions per loop.
"""

import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource


def compile_gluon(fn, signature: dict, constexprs: dict, num_warps: int, aligned=()):
    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = GluonASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
        result = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.path.join(tmp, "kernel.cubin")],
                                capture_output=True, text=True)
    info = [line for line in result.stderr.splitlines() if "Used" in line or "error" in line]
    return compiled, info
