"""Where HF's eager ``generate`` spends a decode step, stock and with each patch: ``torch.profiler``
(CPU and CUDA activities) over greedy decoding of random-weight models.

    python3 tools/eager_profile.py [OUT_DIR] [--layers 8] [--new 16] [--batches 1,16]
                                   [--models llama3-8b,deepseek-v3-h16]   # -> OUT_DIR/eager-profile-<gpu>.json

Per model, variant (stock, swiglu, vq2 with random codes on the Llama shape; mla, mla_swiglu on the
DeepSeek shape) and batch:

* ``ms_per_token``: the model benchmark's eager figure (``bench.hf_decode.generate_eager`` with a
  CUDA-event clock per token, median over the steps after a warm-up decode), without the profiler;
* from one more decode under the profiler, per new token: ``kernel_ms`` (the sum of the GPU
  kernels' durations: what the GPU did), ``launches`` (kernels, memsets and copies), ``host_ms``
  (the profiled wall time of the decode: the profiler adds its own cost, so compare variants,
  not absolute values), ``modules``: the host time inside each MLP, attention and tilefuse module
  class per step (``module_ms``: its forward from entry to exit, launches included, summed over
  the blocks; marked by forward hooks while profiling), and the ops that cost the most CPU time
  of their own (``top_self_cpu``).

A step is host-bound when ``ms_per_token`` is well above ``kernel_ms``: there each patch is
judged by what it adds to or removes from the host's work per step. Needs a CUDA GPU.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from sweep_common import parse_args, sweep_path, write_json

VARIANTS = {"llama3-8b": ("stock", "swiglu", "vq2"), "qwen2.5-1.5b": ("stock", "swiglu", "vq2"),
            "deepseek-v3-h16": ("stock", "mla", "mla_swiglu"), "deepseek-v3": ("stock", "mla", "mla_swiglu")}
PROMPT = 128
TOP = 15


def _marked(module) -> bool:
    name = type(module).__name__
    return name.endswith(("MLP", "Attention")) or type(module).__module__.startswith("tilefuse")


def mark_modules(model) -> list:
    """Forward hooks that open a profiler range ``module:<class>`` around each MLP, attention and
    tilefuse module's forward; returns the handles (remove them after profiling)."""
    import torch

    handles, open_ranges = [], {}

    def enter(module, args):
        rf = torch.autograd.profiler.record_function(f"module:{type(module).__name__}")
        rf.__enter__()
        open_ranges.setdefault(id(module), []).append(rf)

    def leave(module, args, out):
        open_ranges[id(module)].pop().__exit__(None, None, None)

    for module in model.modules():
        if _marked(module):
            handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    return handles


def profile_decode(model, prompt, new_tokens: int, cache_factory, device) -> dict:
    """One eager decode of ``new_tokens`` under torch.profiler; figures per new token."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tilefuse.bench.hf_decode import generate_eager

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    handles = mark_modules(model)
    try:
        with profile(activities=activities) as prof:
            generate_eager(model, prompt, new_tokens, cache=cache_factory())
            if device.type == "cuda":
                torch.cuda.synchronize()
    finally:
        for handle in handles:
            handle.remove()
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    events = prof.events()
    # device work: kernels, memsets and copies (not the GPU-side copies of the user annotations)
    device_events = [e for e in events if e.device_type == cuda and not getattr(e, "is_user_annotation", False)
                     and not e.name.startswith("module:")]
    kernels = [e for e in device_events if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    host = [e for e in events if e.device_type == cpu]
    wall_us = (max(e.time_range.end for e in host) - min(e.time_range.start for e in host)) if host else 0.0
    self_cpu = {a.key: (a.self_cpu_time_total, a.count) for a in prof.key_averages()
                if a.self_cpu_time_total > 0 and not a.key.startswith("module:")}
    modules: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in host:
        if e.name.startswith("module:"):
            modules[e.name.removeprefix("module:")][0] += e.time_range.elapsed_us()
            modules[e.name.removeprefix("module:")][1] += 1
    top = sorted(self_cpu.items(), key=lambda kv: -kv[1][0])[:TOP]
    per = 1.0 / new_tokens
    return {
        "kernel_ms": round(sum(e.time_range.elapsed_us() for e in kernels) / 1e3 * per, 4),
        "launches": round(len(device_events) * per, 1),
        "host_ms": round(wall_us / 1e3 * per, 4),
        "modules": {name: {"module_ms": round(us / 1e3 * per, 4), "calls": round(count * per, 1)}
                    for name, (us, count) in modules.items()},
        "top_self_cpu": [{"op": name, "ms": round(us / 1e3 * per, 4), "calls": round(count * per, 1)}
                         for name, (us, count) in top],
    }


def main() -> None:
    args = parse_args(__doc__, configs=False, workers=False,
                      **{"--layers": dict(type=int, default=8, help="decoder blocks (default 8)"),
                         "--new": dict(type=int, default=16, help="new tokens per decode (default 16)"),
                         "--batches": dict(default="1,16", help="batch sizes (default 1,16)"),
                         "--models": dict(default="llama3-8b,deepseek-v3-h16",
                                          help=f"models, of {', '.join(VARIANTS)} (default llama3-8b,deepseek-v3-h16)")})
    import torch

    from tilefuse.bench import hf_models
    from tilefuse.bench.hf_decode import Clock, generate_eager
    from tilefuse.bench.model import apply_variant, prompts
    from tilefuse.hf.mla import PagedMLACache, is_patched

    device, dtype = torch.device("cuda"), torch.bfloat16
    wanted = args.models.split(",")
    loaders = dict(hf_models.subjects(device, dtype, args.layers, None, quick=True))
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for name in wanted:
        subject = loaders[name]()
        for variant in VARIANTS[name]:
            model = subject.make()
            apply_variant(model, variant, None, {})
            for batch in batches:
                prompt = prompts(subject, None, batch, PROMPT).to(device)

                def cache():
                    if not is_patched(model):
                        return None
                    return PagedMLACache(model, max_batch=batch, max_tokens=PROMPT + args.new)

                generate_eager(model, prompt, args.new, cache=cache())          # warm-up: every cache length
                clock = Clock(device, args.new)
                generate_eager(model, prompt, args.new, clock, cache=cache())
                steps = clock.intervals_ms()[2:]
                row = {"model": name, "variant": variant, "batch": batch, "new_tokens": args.new,
                       "ms_per_token": round(statistics.median(steps), 4),
                       **profile_decode(model, prompt, args.new, cache, device)}
                hf_models.log(f"{name} {variant} b{batch}: {row['ms_per_token']} ms/token, kernels "
                              f"{row['kernel_ms']} ms, {row['launches']} launches, modules "
                              + ", ".join(f"{k} {v['module_ms']} ms" for k, v in row["modules"].items()))
                rows.append(row)
            del model
            torch.cuda.empty_cache()
    path = sweep_path("eager-profile", args.out_dir)
    write_json(path, {"what": __doc__.split("\n\n")[0], "layers": args.layers, "prompt_tokens": PROMPT,
                      "rows": rows})
    print(path)


if __name__ == "__main__":
    main()
