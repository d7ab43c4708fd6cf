"""``tilefuse bench``: run families' cases, print each family's goals table, write JSON and a plot.

stdout gets, per family, a short table of the summary's cases (eager and graph speedup over the
baseline, host cost, roofline fraction, pass/fail of each goal) and the family's goals; progress
goes to stderr; every row and the full summary go to ``<out>/<family>-<gpu>[-quick][-<tag>].json``
with a PNG beside it (:mod:`tilefuse.bench.plot`).

Results file: ``machine`` (gpu, versions, date, host, ``env``: the TILEFUSE_* variables set,
``config_overrides``: the parsed ``TILEFUSE_CONFIGS`` file), ``ceilings`` (copy_gbps read + write,
gemm_bf16_tflops), ``timing`` (how this run timed: ``mode`` "gpu" or "cpu-pipeline-check", and
``fields``: what every row key means), ``rows`` and ``summary`` (each family's ``summarize``).
"""

from __future__ import annotations

import datetime
import importlib
import json
import math
import platform
import sys
from pathlib import Path

import torch

from tilefuse.bench.harness import LEGACY_NOTE, ROW_FIELDS, Ceilings, Timer, measure_ceilings, run_case

FAMILIES = ("swiglu", "swiglu_fp8", "mla", "vq")
DEFAULT_OUT = Path("bench/results")
EAGER_LOOP_MS = 20.0
GPU_TIMING = ("GPU: gpu_us, eager_us and graph_us per row (see fields); tflops, gbps and roofline_frac from "
              "graph_us (kernel speed without host cost)")
CPU_TIMING = ("CPU pipeline check: the PyTorch reference path on toy shapes, eager_us only (time.perf_counter); "
              "not a measurement of tilefuse")


def machine_info(device: torch.device) -> dict:
    """gpu (name), torch, triton, cuda, date (UTC), host, env (the TILEFUSE_* and TRITON_INTERPRET
    variables set) and config_overrides (the parsed TILEFUSE_CONFIGS file, {} without one)."""
    import triton

    from tilefuse import _env

    on_gpu = device.type == "cuda"
    gpu = torch.cuda.get_device_name(device) if on_gpu else f"cpu ({platform.processor() or platform.machine()})"
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "env": _env.active(),
        "config_overrides": _env.settings.configs,
    }


def _slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"h200"``, ``"cpu (x86_64)"`` -> ``"cpu-x86-64"``."""
    words = "".join(c.lower() if c.isalnum() else " " for c in name).split()
    return "-".join(w for w in words if w != "nvidia")


def _fmt(x, spec=".2f", suffix=""):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec) + suffix


def _verdict(checks) -> str:
    """"ok" if every judged check is met, "FAIL" if one is not, "-" if none was judged."""
    judged = [c["met"] for c in checks if c and c["met"] is not None]
    return "-" if not judged else "ok" if all(judged) else "FAIL"


def print_summary(family: str, summary: dict, file=None) -> None:
    """The summary's cases as a table (speedups = baseline time / tilefuse time), then its goals."""
    file = file or sys.stdout
    width = max([len(e["case"]) for e in summary["cases"]] + [4])
    print(f"\n{family}: speedup = baseline time / tilefuse time; host = tilefuse eager_us / its graph_us",
          file=file)
    print(f"{'case':<{width}}  {'baseline':<12} {'eager':>7} {'graph':>7} {'host':>6} {'roof':>5}  "
          "host goal  kernel goal", file=file)
    for e in summary["cases"]:
        print(f"{e['case']:<{width}}  {e['baseline'] or '-':<12} {_fmt(e['eager_speedup'], '.2f', 'x'):>7} "
              f"{_fmt(e['graph_speedup'], '.2f', 'x'):>7} {_fmt(e['eager_over_graph']):>6} "
              f"{_fmt(e['roofline_frac']):>5}  {_verdict([e['host_goal']]):<9}  {_verdict(e['kernel_goals'])}",
              file=file)
    print(f"{family} goals:", file=file)
    for goal in summary["goals"]:
        if "met_in" in goal:
            measured = f"met in {goal['met_in']}/{goal['of']} cases"
        else:
            measured = f"{_fmt(goal['measured'], '.3f')} (target {goal['target']})"
        state = {True: "ok", False: "FAIL", None: "not measured"}[goal["met"]]
        print(f"  [{state}] {goal['goal']}: {measured}", file=file)


def select_cases(module, family: str, device: torch.device, quick: bool, only: str | None) -> list:
    """``module.cases(device, quick, subset)``, keeping those whose params JSON contains ``only``."""
    cases = module.cases(device, quick, bool(only))
    if not only:
        return cases
    picked = [c for c in cases if only in json.dumps(c.params)]
    if not picked:
        example = json.dumps(cases[0].params) if cases else "{}"
        print(f"--only {only!r}: no {family} case matches (its params look like {example})", file=sys.stderr)
    return picked


def run_family(family: str, cases: list, timer: Timer, ceilings: Ceilings, progress=None) -> list[dict]:
    """Time every case; returns the result rows. ``progress(rows)`` is called after every case
    (the runner saves the rows so far, so a run cut short still leaves them)."""
    rows = []
    for i, case in enumerate(cases, 1):
        print(f"[{family} {i}/{len(cases)}] {case.params}", file=sys.stderr, flush=True)
        rows.extend(run_case(case, family, timer, ceilings))
        if progress is not None:
            progress(rows)
    return rows


def result_path(family: str, machine: dict, out_dir: Path, quick: bool = False, tag: str | None = None) -> Path:
    """``<out_dir>/<family>-<gpu>[-quick][-<tag>].json``: a tagged (e.g. partial) run never overwrites
    the full run's file."""
    suffix = ("-quick" if quick else "") + ("-" + _slug(tag) if tag else "")
    return out_dir / f"{family}-{_slug(machine['gpu'])}{suffix}.json"


def header(device: torch.device, ceilings: Ceilings, timer: Timer) -> dict:
    """The part of a results file that every family of one run shares: machine, ceilings, timing."""
    on_gpu = device.type == "cuda"
    return {
        "machine": machine_info(device),
        "ceilings": {"copy_gbps": ceilings.copy_gbps, "gemm_bf16_tflops": ceilings.gemm_bf16_tflops},
        "timing": {"mode": "gpu" if on_gpu else "cpu-pipeline-check", "note": GPU_TIMING if on_gpu else CPU_TIMING,
                   "do_bench_rep_ms": timer.rep_ms, "eager_loop_ms": timer.eager_ms, "fields": ROW_FIELDS},
    }


def write_results(family: str, rows: list[dict], head: dict, out_dir: Path, summary: dict | None = None,
                  quick: bool = False, tag: str | None = None) -> Path:
    """``head`` (:func:`header`) + rows (+ summary) as JSON at :func:`result_path`; with a ``summary``
    (a finished run) a PNG beside it, without one the file is marked ``"incomplete": true``.
    Returns the JSON path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = result_path(family, head["machine"], out_dir, quick, tag)
    payload = {**head, "rows": rows}
    if summary is None:
        payload["incomplete"] = True
    else:
        payload["summary"] = summary
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    if summary is not None:
        _plot(family, summary, path.with_suffix(".png"), head["machine"])
    return path


def _plot(family: str, summary: dict, path: Path, machine: dict) -> None:
    try:
        from tilefuse.bench.plot import plot_family
    except ImportError as exc:
        print(f"(no plot: {exc})", file=sys.stderr)
        return
    title = (f"tilefuse bench {family}: {machine['gpu']}, {machine['date'][:10]}, torch {machine['torch']}, "
             f"triton {machine['triton']}")
    if machine["gpu"].startswith("cpu"):
        title += " (CPU pipeline check, not a measurement)"
    plot_family(family, summary, path, title=title)


def resummarize(path: Path) -> tuple[str, dict]:
    """Recompute the summary of a results file from its rows (any schema: older rows are read as
    :func:`~tilefuse.bench.harness.upgrade_rows` says), write it back and redraw the PNG; the rows
    are left as they are. Returns (family, summary)."""
    data = json.loads(Path(path).read_text())
    family = data["rows"][0]["family"]
    data["summary"] = importlib.import_module(f"tilefuse.bench.{family}").summarize(data["rows"])
    if any("median_us" in row for row in data["rows"]):
        data.setdefault("timing", {"mode": "gpu", "note": LEGACY_NOTE})
    Path(path).write_text(json.dumps(data, indent=1, default=str) + "\n")
    _plot(family, data["summary"], Path(path).with_suffix(".png"), data["machine"])
    return family, data["summary"]


def main(families: list[str], quick: bool, out_dir: Path, only: str | None = None, rep_ms: float | None = None,
         tag: str | None = None) -> int:
    """Benchmark ``families``; an ``only`` run is tagged "only" unless ``tag`` names it otherwise.

    Returns 2 (and writes nothing) when ``only`` matches no case of any of the families; a family
    it does not match is skipped with a message on stderr."""
    tag = tag or ("only" if only else None)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    selected = {}
    for family in families:
        try:
            module = importlib.import_module(f"tilefuse.bench.{family}")
        except ModuleNotFoundError as exc:
            print(f"{family}: no benchmark yet ({exc})", file=sys.stderr)
            continue
        cases = select_cases(module, family, device, quick, only)
        if cases:
            selected[family] = (module, cases)
    if not selected:
        return 2
    if device.type != "cuda":
        print("No CUDA GPU here: running the reference path on small CPU shapes "
              "(eager wall-clock times only, for checking the pipeline).", file=sys.stderr)
    ceilings = measure_ceilings(device, quick)
    print(f"ceilings: copy {ceilings.copy_gbps:.0f} GB/s, bf16 GEMM {ceilings.gemm_bf16_tflops:.0f} TFLOP/s",
          file=sys.stderr)
    rep = rep_ms or (20.0 if quick else 50.0)
    timer = Timer(device, rep_ms=rep, eager_ms=EAGER_LOOP_MS if device.type == "cuda" else min(EAGER_LOOP_MS, rep))
    head = header(device, ceilings, timer)
    print(f"machine: {head['machine']}", file=sys.stderr)
    if device.type != "cuda":
        print(f"({CPU_TIMING})")
    for family, (module, cases) in selected.items():
        def save_so_far(rows, family=family):  # a run cut short (timeout) still leaves its rows
            write_results(family, rows, head, out_dir, quick=quick, tag=tag)

        rows = run_family(family, cases, timer, ceilings, progress=save_so_far)
        summary = module.summarize(rows)
        path = write_results(family, rows, head, out_dir, summary, quick=quick, tag=tag)
        print_summary(family, summary)
        print(f"wrote {path} and {path.with_suffix('.png').name}", file=sys.stderr)
    return 0
