"""``tilefuse bench``: run families' cases, print a table, write JSON and a plot per family."""

from __future__ import annotations

import datetime
import importlib
import json
import math
import platform
import sys
from pathlib import Path

import torch

from tilefuse.bench.harness import Ceilings, Timer, best_us, measure_ceilings, run_case

FAMILIES = ("swiglu", "mla", "vq")
DEFAULT_OUT = Path("bench/results")


def machine_info(device: torch.device) -> dict:
    import triton

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})"
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
    }


def _slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"h200"``, ``"cpu (x86_64)"`` -> ``"cpu-x86-64"``."""
    words = "".join(c.lower() if c.isalnum() else " " for c in name).split()
    return "-".join(w for w in words if w != "nvidia")


def _fmt(x, spec=".1f"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_table(rows: list[dict], file=None) -> None:
    """One line per (case, impl): eager and graph-replay time, TFLOP/s, GB/s, roofline fraction,
    and each baseline's time over tilefuse's (both at their best of eager and graph replay)."""
    file = file or sys.stdout
    by_case: dict[str, list[dict]] = {}
    for row in rows:
        by_case.setdefault(json.dumps(row["params"], sort_keys=True), []).append(row)
    print(f"{'case':<52} {'impl':<22} {'us':>9} {'graph us':>9} {'TFLOP/s':>8} {'GB/s':>7} {'roof':>5}  vs tilefuse",
          file=file)
    for group in by_case.values():
        ours = next((best_us(r) for r in group if r["impl"] == "tilefuse" and best_us(r)), None)
        case = " ".join(f"{k}={v}" for k, v in group[0]["params"].items())[:52]
        for row in group:
            speed = ""
            if ours and row["impl"] != "tilefuse" and best_us(row):
                speed = f"{best_us(row) / ours:.2f}x"
            if row.get("error"):
                speed = "ERROR " + row["error"][:60]
            print(f"{case:<52} {row['impl']:<22} {_fmt(row.get('median_us')):>9} {_fmt(row.get('graph_us')):>9} "
                  f"{_fmt(row.get('tflops')):>8} {_fmt(row.get('gbps'), '.0f'):>7} "
                  f"{_fmt(row.get('roofline_frac'), '.2f'):>5}  {speed}", file=file)
            case = ""


def run_family(module, family: str, device: torch.device, quick: bool, timer: Timer, ceilings: Ceilings,
               only: str | None = None, progress=None) -> list[dict]:
    """Run every case of ``module.cases(device, quick)`` (filtered by ``only``); returns result rows.
    ``progress(rows)`` is called after every case (the runner saves the rows so far)."""
    cases = module.cases(device, quick)
    if only:
        cases = [c for c in cases if only in json.dumps(c.params)]
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
    return out_dir / f"{family}-{_slug(machine['gpu'])}{'-quick' if quick else ''}{'-' + _slug(tag) if tag else ''}.json"


def write_results(family: str, rows: list[dict], machine: dict, ceilings: Ceilings, out_dir: Path,
                  extra: dict | None = None, quick: bool = False, tag: str | None = None, plot: bool = True) -> Path:
    """The JSON at :func:`result_path` and (``plot``) a PNG beside it; returns the JSON path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = result_path(family, machine, out_dir, quick, tag)
    payload = {
        "machine": machine,
        "ceilings": {"copy_gbps": ceilings.copy_gbps, "gemm_bf16_tflops": ceilings.gemm_bf16_tflops},
        "rows": rows,
    }
    if extra:
        payload.update(extra)
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    if not plot:
        return path
    try:
        from tilefuse.bench.plot import plot_family

        plot_family(family, rows, path.with_suffix(".png"))
    except ImportError as exc:
        print(f"(no plot: {exc})", file=sys.stderr)
    return path


def main(families: list[str], quick: bool, out_dir: Path, only: str | None = None, rep_ms: float | None = None,
         tag: str | None = None) -> int:
    """Benchmark ``families``; an ``only`` run is tagged "only" unless ``tag`` names it otherwise."""
    tag = tag or ("only" if only else None)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type != "cuda":
        print("No CUDA GPU here: running the reference path on small CPU shapes "
              "(timings are CPU timings, for checking the pipeline only).", file=sys.stderr)
    machine = machine_info(device)
    print(f"machine: {machine}", file=sys.stderr)
    ceilings = measure_ceilings(device, quick)
    print(f"ceilings: copy {ceilings.copy_gbps:.0f} GB/s, bf16 GEMM {ceilings.gemm_bf16_tflops:.0f} TFLOP/s",
          file=sys.stderr)
    timer = Timer(device, rep_ms=rep_ms or (20.0 if quick else 50.0))
    for family in families:
        try:
            module = importlib.import_module(f"tilefuse.bench.{family}")
        except ModuleNotFoundError as exc:
            print(f"{family}: no benchmark yet ({exc})", file=sys.stderr)
            continue
        def save_so_far(rows, family=family):  # a run cut short (timeout) still leaves its rows
            write_results(family, rows, machine, ceilings, out_dir, {"incomplete": True}, quick=quick, tag=tag,
                          plot=False)

        rows = run_family(module, family, device, quick, timer, ceilings, only, progress=save_so_far)
        print_table(rows)
        summary = module.summarize(rows) if hasattr(module, "summarize") else None
        if summary:
            print(json.dumps(summary, indent=1))
        path = write_results(family, rows, machine, ceilings, out_dir, {"summary": summary} if summary else None,
                             quick=quick, tag=tag)
        print(f"wrote {path}", file=sys.stderr)
    return 0
