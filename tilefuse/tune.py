"""``tilefuse tune``: measure the dispatch's candidates on this GPU for a model's shapes and write
the table the dispatch then reads (``tilefuse._dispatch.tuned_table``).

For each SwiGLU problem ``(H, I)`` of the model (dense MLP, routed and shared experts, each
tensor-parallel shard asked for) and each token bucket the dispatch keys on (M = 1, 16, 64, 128,
1024, 4096, 16384: an entry serves the M up to it), every candidate -- the cost model's picks,
a few tile variants around them, and the unfused path (cuBLAS GEMM + SiLU·mul) -- runs once
against the fp64 reference and is then timed by CUDA-graph replay (median, cold L2); the fastest
correct one becomes the entry. What vLLM does for its fused-MoE configs, per op and shape bucket.

The table lands in ``$XDG_CACHE_HOME/tilefuse/tuned-<gpu>.json`` (``~/.cache`` by default;
``--out`` elsewhere, then point ``TILEFUSE_CONFIGS`` at it) and is merged with what is there.
Without a GPU the pipeline runs on the reference path: every candidate is called once, nothing
is timed, and each entry is the cost model's pick, marked ``"measured": false`` (a pipeline
check; the table is keyed to the "cpu" device, which only interpreter runs consult).

    tilefuse tune --model-type deepseek-v3 --tp 1,8
    tilefuse tune --config path/to/config.json
    tilefuse tune --shapes 7168x2048,4096x14336 --tokens 1,16
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

import torch

from tilefuse import _dispatch

TUNE_M = (1, 16, 64, 128, 1024, 4096, 16384)


def shapes_from_config(config: dict, tp_degrees=(1,)) -> list[tuple[int, int]]:
    """(H, I) of the SwiGLU MLPs described by a Hugging Face ``config.json`` dict: the dense MLP
    (``intermediate_size``), the routed experts (``moe_intermediate_size``) and the shared ones
    (``n_shared_experts`` x the expert size, or ``shared_expert_intermediate_size``), each split
    by every tensor-parallel degree that divides it into multiples of 8."""
    from tilefuse.testing.corpus import ModelConfig, swiglu_shapes

    hidden = config.get("hidden_size")
    if not isinstance(hidden, int) or hidden <= 0:
        raise ValueError(f"config: expected a positive integer hidden_size, got {hidden!r}")
    moe = config.get("moe_intermediate_size")
    shared = config.get("shared_expert_intermediate_size")
    if shared is None and moe and config.get("n_shared_experts"):
        shared = moe * config["n_shared_experts"]
    model = ModelConfig(config.get("model_type", "config"), hidden, config.get("intermediate_size"),
                        config.get("num_attention_heads", 1), config.get("num_key_value_heads", 1), 1,
                        moe, config.get("n_routed_experts", config.get("num_experts", 0)) or 0, shared)
    return [s.dims for s in swiglu_shapes(model, tp_degrees)]


def _candidates(m: int, h: int, i: int, num_sms: int, pingpong: bool) -> list[tuple[str, object]]:
    """The cost model's candidates plus tile variants around its picks (split-K doubled and halved,
    the other N tile, the stream-K tail, the ping-pong kernel where it runs) and the shipped
    table's entry at this M."""
    from tilefuse.ops.swiglu import configs

    picks = configs.candidates(m, h, i, num_sms)
    extra = []
    for variant, cfg in picks:
        if variant == "small_m":
            for split in {max(1, cfg.split_k // 2), cfg.split_k * 2}:
                extra.append((variant, dataclasses.replace(cfg, split_k=split)))
            extra.append((variant, dataclasses.replace(cfg, block_n=32 if cfg.block_n == 64 else 64)))
        elif variant == "large_m":
            extra.append((variant, dataclasses.replace(cfg, stream_k=1)))
            extra.append((variant, dataclasses.replace(cfg, block_n=64, num_warps=4, warp_specialize=False)))
    if pingpong and m >= 128:
        extra.append(("pingpong", configs.PingPongConfig()))
        extra.append(("pingpong", configs.PingPongConfig(64, 128, 64, 8, 4)))
    shipped = configs.TUNED.get((h, i), {}).get(m)      # the shipped table's pick at this M, if any
    if shipped is not None and shipped != configs.U and (pingpong or not isinstance(shipped, configs.PingPongConfig)):
        extra.append((configs.variant_of(shipped), shipped))
    seen, out = set(), []
    for cand in picks + extra:
        if cand not in seen:
            seen.add(cand)
            out.append(cand)
    return out


def tune_swiglu(shapes, tokens=TUNE_M, device=None, rep_ms: float = 25.0, progress: bool = True) -> dict:
    """``{"H,I": {"M": entry}}`` for ``shapes`` ([(H, I)]) at ``tokens``: each entry names the
    fastest correct candidate (``variant``, ``config``), its time and every candidate's time
    (``us``: graph replay, None where it failed or was wrong), or on a CPU the cost model's pick
    with ``measured: false``."""
    from tilefuse.bench.harness import Timer
    from tilefuse.ops.swiglu import configs, op
    from tilefuse.testing.swiglu import make_case, reference_fp64

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    num_sms = op.device_num_sms(device, cpu_default=configs.NUM_SMS_H200)
    pingpong = on_gpu and op.pingpong_usable(device)
    timer = Timer(device, rep_ms=rep_ms) if on_gpu else None
    table: dict = {}
    work = [(h, i, m) for h, i in shapes for m in tokens]
    start = time.perf_counter()
    for n, (h, i, m) in enumerate(work):
        if on_gpu:
            x, w, _ = make_case(m, h, i, torch.bfloat16, device)
            ref = reference_fp64(x[: min(m, 64)], w)
            times = {}
            for variant, cfg in _candidates(m, h, i, num_sms, pingpong):
                name = _label(variant, cfg)
                out = torch.empty(m, i, dtype=x.dtype, device=device)
                try:
                    op.run_kernel(x, w, None, "merged", variant, cfg, out=out)
                    err = (out[: ref.shape[0]].double() - ref).abs().max().item()
                    ok = err <= 0.02 * ref.abs().max().item() + 1e-3        # bf16: a wrong tile is O(1) off
                    times[name] = timer.graph_us(lambda: op.run_kernel(x, w, None, "merged", variant, cfg,
                                                                        out=out)) if ok else None
                except Exception as exc:  # a candidate that does not compile or launch here is skipped
                    times[name] = None
                    if progress:
                        print(f"tilefuse tune: {name} at {m}x{h}x{i}: {type(exc).__name__}: {exc}"[:200],
                              file=sys.stderr)
            timed = [(t, c) for c, t in times.items() if t is not None]
            if not timed:
                raise RuntimeError(f"tilefuse tune: no candidate ran correctly at M={m}, H={h}, I={i} (each one "
                                   f"failed to launch or disagreed with the fp64 reference; stderr names why)")
            best = min(timed)
            variant, cfg = _unlabel(best[1])
            entry = {"variant": variant, "config": None if cfg is None else dataclasses.asdict(cfg),
                     "graph_us": best[0], "us": times, "measured": True}
            del x, w
        else:   # the pipeline on the reference path, at a small size: nothing to time here
            import tilefuse

            x, w, _ = make_case(min(m, 4), 64, 64, torch.float32, device)
            with tilefuse.force(backend="reference"):
                tilefuse.swiglu(x, w)
            choice = configs.decide(m, h, i, num_sms)
            entry = {"variant": choice.variant, "measured": False,
                     "config": None if choice.config is None else dataclasses.asdict(choice.config)}
        table.setdefault(f"{h},{i}", {})[str(m)] = entry
        if progress:
            done = n + 1
            eta = (time.perf_counter() - start) / done * (len(work) - done)
            print(f"tilefuse tune [{done}/{len(work)}] swiglu H={h} I={i} M={m}: {entry['variant']}"
                  f"{' %.1f us' % entry['graph_us'] if 'graph_us' in entry else ''} (about {eta:.0f} s left)",
                  file=sys.stderr, flush=True)
    return table


def _label(variant: str, cfg) -> str:
    return variant if cfg is None else f"{variant}:{json.dumps(dataclasses.asdict(cfg), sort_keys=True)}"


def _unlabel(label: str):
    from tilefuse.ops.swiglu import configs

    variant, _, spec = label.partition(":")
    return variant, None if not spec else configs.CONFIG_CLASSES[variant](**json.loads(spec))


def write_table(swiglu: dict, path: Path, device: torch.device) -> Path:
    """Merge ``swiglu`` entries into the table file at ``path`` (created if absent)."""
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault("tuned", {}).setdefault("swiglu", {})
    for shape, per_m in swiglu.items():
        data["tuned"]["swiglu"].setdefault(shape, {}).update(per_m)
    data["machine"] = {"gpu": _dispatch.gpu_name(device), "torch": torch.__version__,
                       "triton": _triton_version(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True))
    _dispatch.reload_tuned()
    from tilefuse.ops.swiglu import configs, op

    configs.decide.cache_clear()
    op.plan.cache_clear()
    return path


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:  # pragma: no cover - Linux installs bring Triton
        return None
    return triton.__version__


def main(model_types=(), config: Path | None = None, shapes: str | None = None, tp: str = "1",
         tokens: str | None = None, out: Path | None = None, rep_ms: float = 25.0) -> int:
    """The CLI's ``tune``: returns the exit code (0 when a table was written). Bad arguments raise
    ValueError naming the option (the CLI prints it on one line and exits 2)."""
    from tilefuse.testing.corpus import MODELS, swiglu_shapes

    tp_degrees = _ints("tp", tp)
    token_list = _ints("tokens", tokens) if tokens else TUNE_M
    # (H, I) of each MLP before sharding, with where it came from (for the errors)
    unsharded: list[tuple[int, int, str]] = []
    for name in model_types:
        if name not in MODELS:
            raise ValueError(f"--model-type: expected one of {sorted(MODELS)}, got {name!r}")
        unsharded += [(*s.dims, f"--model-type {name} (its {s.role} MLP, H x I = {s.dims[0]}x{s.dims[1]})")
                      for s in swiglu_shapes(MODELS[name], (1,))]
    if config is not None:
        unsharded += [(h, i, f"--config {config} (H x I = {h}x{i})") for h, i in _config_shapes(Path(config))]
    if shapes:
        for item in shapes.split(","):
            try:
                h, i = (int(v) for v in item.lower().split("x"))
            except ValueError:
                raise ValueError(f"--shapes: expected HxI[,HxI...] (e.g. 7168x2048), got {item!r}") from None
            if h <= 0 or i <= 0 or h % 8 or i % 8:
                raise ValueError(f"--shapes: expected H and I positive multiples of 8, got {item!r}")
            unsharded.append((h, i, f"--shapes {item}"))
    if not unsharded:
        raise ValueError("name a model (--model-type), a config (--config) or --shapes")
    problems = list(dict.fromkeys(_shard(unsharded, tp_degrees)))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = out or _dispatch.tuned_path(_dispatch.gpu_name(device))
    if device.type != "cuda":
        print("tilefuse tune: no CUDA GPU: pipeline check on the reference path, nothing timed; the entries are "
              "the cost model's picks", file=sys.stderr)
    table = tune_swiglu(problems, token_list, device, rep_ms)
    written = write_table(table, Path(path), device)
    print(f"tilefuse tune: {len(table)} SwiGLU shapes x {len(token_list)} token counts -> {written}")
    return 0


def _shard(unsharded, tp_degrees) -> list[tuple[int, int]]:
    """``(H, I / tp)`` for every shape and tensor-parallel degree (I is what tensor parallelism
    splits); a degree that does not split I into multiples of 8 (the kernels' I) is an error."""
    out = []
    for h, i, source in unsharded:
        for tp in tp_degrees:
            if i % tp or (i // tp) % 8:
                raise ValueError(f"--tp: {tp} does not split I = {i} of {source} into multiples of 8; "
                                 f"use degrees that do, or leave that shape out")
            out.append((h, i // tp))
    return out


def _config_shapes(path: Path) -> list[tuple[int, int]]:
    """(H, I) of the MLPs of the Hugging Face ``config.json`` at ``path`` (unsharded); errors name
    --config and the file."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"--config: cannot read {path}: {exc.strerror or exc}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--config: {path} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--config: expected a JSON object (a Hugging Face config.json) in {path}, "
                         f"got a {type(config).__name__}")
    try:
        return shapes_from_config(config)
    except ValueError as exc:
        raise ValueError(f"--config: {path}: {str(exc).removeprefix('config: ')}") from None


def _ints(name: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in str(text).split(","))
    except ValueError:
        raise ValueError(f"--{name}: expected comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--{name}: expected comma-separated positive integers, got {text!r}")
    return values
