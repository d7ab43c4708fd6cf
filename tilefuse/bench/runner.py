"""``tilefuse bench``: run families' cases, print each family's goals table, write JSON and a plot.

On a GPU, stdout gets per family a short table of the summary's cases (eager and graph speedup
over the baseline, host cost, roofline fraction, pass/fail of each goal) and the family's goals;
progress goes to stderr; every row and the full summary go to
``<out>/<family>-<gpu>[-quick][-<tag>].json`` with a PNG beside it (:mod:`tilefuse.bench.plot`).

Without a GPU each implementation is called once on toy shapes through the reference path and
nothing is timed: stdout gets one "pipeline check" line per family, the results file the rows (no
times) and a ``pipeline_check`` summary, and no PNG is drawn. A family with no case on this
machine (``swiglu_fp8`` without an sm_90 GPU) says why and is not run.

Results file: ``machine`` (gpu, versions, date, host, ``env``: the TILEFUSE_* variables set,
``config_overrides``: the parsed ``TILEFUSE_CONFIGS`` file), ``ceilings`` (copy_gbps read + write,
gemm_bf16_tflops; None without a GPU), ``timing`` (how this run timed: ``mode`` "gpu" or
"cpu-pipeline-check", and ``fields``: what every row key means), ``rows`` and ``summary`` (each
family's ``summarize`` on a GPU, :func:`pipeline_check` on a CPU).
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

from tilefuse import _registry
from tilefuse.bench.harness import LEGACY_NOTE, ROW_FIELDS, Ceilings, Timer, measure_ceilings, run_case

FAMILIES = tuple(_registry.FAMILIES)     # the kernel families (tilefuse/_registry.py)
# Families run by name only, not by `tilefuse bench all` (corpus: about an hour on an H200).
STANDALONE = ("corpus",)
DEFAULT_OUT = Path("bench/results")
EAGER_LOOP_MS = 20.0
GPU_TIMING = ("GPU: gpu_us, eager_us and graph_us per row (see fields); tflops, gbps and roofline_frac from "
              "graph_us (kernel speed without host cost)")
CPU_TIMING = ("CPU pipeline check: every implementation called once through the PyTorch reference path on toy "
              "shapes; nothing timed")


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
    """The summary's cases as a table (speedups = baseline time / tilefuse time), then its goals;
    a CPU run's summary (:func:`pipeline_check`) as its one line; a family module that defines
    ``print_family_summary(summary, file)`` prints its own, one that defines
    ``print_family_extra(summary, file)`` adds its own table after the goals."""
    file = file or sys.stdout
    if "pipeline_check" in summary:
        print(pipeline_line(family, summary["pipeline_check"]), file=file)
        return
    own = getattr(importlib.import_module(f"tilefuse.bench.{family}"), "print_family_summary", None)
    if own is not None:   # a family with its own table (corpus: per token bucket, not per case)
        own(summary, file=file)
        return
    width = max([len(e["case"]) for e in summary["cases"]] + [4])
    print(f"\n{family}: eager, graph: speedup, baseline time / tilefuse time (> 1: tilefuse faster); "
          "host: tilefuse eager_us / its graph_us", file=file)
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
    extra = getattr(importlib.import_module(f"tilefuse.bench.{family}"), "print_family_extra", None)
    if extra is not None:   # a second table of the family's own (mla: the FP8-cache cases)
        extra(summary, file=file)


def pipeline_check(cases: list, rows: list[dict]) -> dict:
    """The summary of a CPU run: ``{"pipeline_check": {"cases", "calls", "failed"}}``, ``failed``
    listing each call (or accuracy check) that raised, as ``"<impl> <params>: <error>"``."""
    failed = [f"{r['impl']} {json.dumps(r['params'])}: {r.get('error') or r.get('extras_error')}"
              for r in rows if r.get("error") or r.get("extras_error")]
    return {"pipeline_check": {"cases": len(cases), "calls": len(rows), "failed": failed}}


def pipeline_line(family: str, check: dict) -> str:
    """``"<family>: pipeline check: N cases ran on the reference path, nothing timed"`` (+ failures)."""
    cases = f"{check['cases']} case{'s' if check['cases'] != 1 else ''}"
    line = f"{family}: pipeline check: {cases} ran on the reference path, nothing timed"
    if check["failed"]:
        line += f"; {len(check['failed'])} of {check['calls']} calls FAILED, first: {check['failed'][0]}"
    return line


def unavailable(module, device: torch.device) -> str:
    """Why a family has no case on ``device``: its module's ``unavailable(device)``, or a generic line."""
    why = getattr(module, "unavailable", None)
    return (why(device) if why else None) or "no case on this machine"


def select_cases(cases: list, family: str, only: str | None) -> list:
    """The ``cases`` whose params JSON contains ``only`` (all of them without ``only``)."""
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
    if device.type == "cuda":
        timing = {"mode": "gpu", "note": GPU_TIMING, "do_bench_rep_ms": timer.rep_ms, "eager_loop_ms": timer.eager_ms}
    else:
        timing = {"mode": "cpu-pipeline-check", "note": CPU_TIMING}
    return {
        "machine": machine_info(device),
        "ceilings": {"copy_gbps": ceilings.copy_gbps, "gemm_bf16_tflops": ceilings.gemm_bf16_tflops},
        "timing": {**timing, "fields": ROW_FIELDS},
    }


def write_results(family: str, rows: list[dict], head: dict, out_dir: Path, summary: dict | None = None,
                  quick: bool = False, tag: str | None = None) -> Path:
    """``head`` (:func:`header`) + rows (+ summary) as JSON at :func:`result_path`; with a ``summary``
    of a GPU run a PNG beside it; without a summary the file is marked ``"incomplete": true``.
    Returns the JSON path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = result_path(family, head["machine"], out_dir, quick, tag)
    payload = {**head, "rows": rows}
    if summary is None:
        payload["incomplete"] = True
    else:
        payload["summary"] = summary
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    if summary is not None and head["timing"]["mode"] == "gpu":
        _plot(family, summary, path.with_suffix(".png"), head["machine"])
    return path


def _plot(family: str, summary: dict, path: Path, machine: dict) -> None:
    if not summary.get("cases"):   # e.g. an --only run of mla's FP8-cache cases: their table is in the JSON only
        return
    try:
        from tilefuse.bench.plot import plot_family
    except ImportError as exc:
        print(f"(no plot: {exc})", file=sys.stderr)
        return
    title = (f"tilefuse bench {family}: {machine['gpu']}, {machine['date'][:10]}, torch {machine['torch']}, "
             f"triton {machine['triton']}")
    plot_family(family, summary, path, title=title)


def resummarize(path: Path) -> tuple[str, dict]:
    """Recompute the summary of a results file from its rows (any schema: older rows are read as
    :func:`~tilefuse.bench.harness.upgrade_rows` says), write it back and redraw the PNG; the rows
    are left as they are. Returns (family, summary)."""
    data = json.loads(Path(path).read_text())
    if data.get("timing", {}).get("mode") == "cpu-pipeline-check":
        raise ValueError(f"path: {path} is a CPU pipeline check: nothing was timed, so there is nothing to summarize")
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

    A family with no case on this machine says why on stdout and is not run. Returns 0 when the
    families with cases ran (without a GPU: their pipeline checks passed); 1 when none has a case
    here, or a pipeline check failed; 2 (writing nothing) when ``only`` matches no case of any
    family (a family it does not match is skipped with a message on stderr)."""
    if rep_ms is not None and not (math.isfinite(rep_ms) and rep_ms > 0):
        raise ValueError(f"rep_ms: expected a positive number of milliseconds, got {rep_ms!r}")
    tag = tag or ("only" if only else None)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    selected, not_run = {}, {}
    for family in families:
        module = importlib.import_module(f"tilefuse.bench.{family}")
        cases = module.cases(device, quick, bool(only))
        if not cases:
            not_run[family] = f"{family}: not run: {unavailable(module, device)}"
        elif picked := select_cases(cases, family, only):
            selected[family] = (module, picked)
    if not selected:
        for line in not_run.values():
            print(line, flush=True)
        return 1 if len(not_run) == len(families) else 2
    on_gpu = device.type == "cuda"
    ceilings = measure_ceilings(device, quick)
    if on_gpu:
        print(f"ceilings: copy {ceilings.copy_gbps:.0f} GB/s, bf16 GEMM {ceilings.gemm_bf16_tflops:.0f} TFLOP/s",
              file=sys.stderr)
    else:
        print(f"No CUDA GPU here: {CPU_TIMING}.", file=sys.stderr)
    rep = rep_ms or (20.0 if quick else 50.0)
    timer = Timer(device, rep_ms=rep, eager_ms=EAGER_LOOP_MS)
    head = header(device, ceilings, timer)
    print(f"machine: {head['machine']}", file=sys.stderr)
    status = 0
    for family in families:
        if family in not_run:
            print(not_run[family], flush=True)
        if family not in selected:
            continue
        module, cases = selected[family]

        def save_so_far(rows, family=family):  # a run cut short (timeout) still leaves its rows
            write_results(family, rows, head, out_dir, quick=quick, tag=tag)

        rows = run_family(family, cases, timer, ceilings, progress=save_so_far)
        summary = module.summarize(rows) if on_gpu else pipeline_check(cases, rows)
        path = write_results(family, rows, head, out_dir, summary, quick=quick, tag=tag)
        print_summary(family, summary)
        if not on_gpu and summary["pipeline_check"]["failed"]:
            status = 1
        print(f"wrote {path}" + (f" and {path.with_suffix('.png').name}" if on_gpu else ""), file=sys.stderr)
    return status
