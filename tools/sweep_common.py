"""What the tuning tools share: the ``TILEFUSE_CONFIGS`` file they write, running a candidate in a
fresh process, their command line, where their timings go, and the check that a GPU is there.

The file is one JSON object, one section per family, each in the format its ``configs.py``
documents::

    {"swiglu": [{"H": 3584, "I": 18944, "M": 128, "variant": "large_m", "config": {...}}, ...],
     "mla":    {"transposed": {...}, "standard:long": {...}, "small_rows_variant": {"short": ..., "long": ...}},
     "vq":     {"resident": {"block_r": 128, ...}, "gather": {...}}}

Every sweep takes ``[OUT_DIR]``: its full timings go to ``OUT_DIR/<name>-<gpu>.json``, by default
``bench/results/sweeps/<name>-<gpu>.json`` (:func:`sweep_path`). A sweep that picks launch
settings also takes ``--configs FILE`` (default ``OUT_DIR/configs.json``, or ``configs.json`` in
the current folder without an ``OUT_DIR``): it starts from the file's contents and merges its
picks into its own family's section, so sweeps of several families can share one file. Then
measure the picks with ``TILEFUSE_CONFIGS=FILE tilefuse bench <family>`` (the results file records
the variable and the file's contents in its ``machine`` block) and copy the winners into the
family's ``configs.py``.
The library reads the file when it is imported, so the sweeps time every candidate in a fresh
process (:func:`run_with_configs`), exactly as the benchmark would run it.

On a machine without a CUDA GPU a sweep says so in one line and exits with status 1
(:func:`require_gpu`) once its arguments are read, so ``--help`` works anywhere.

``tools/`` is on ``sys.path`` when one of the tools runs as a script, so they ``import sweep_common``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SWEEPS = Path("bench/results/sweeps")


def require_gpu(min_capability: tuple[int, int] | None = None, otherwise: str = "") -> None:
    """End the running tool with one line on stderr and exit status 1 where it cannot run: torch
    sees no CUDA GPU, or the GPU is older than ``min_capability`` (e.g. ``(9, 0)`` for Hopper).
    ``otherwise``: what else would do, added to the no-GPU line (e.g. "or TRITON_INTERPRET=1")."""
    tool = f"tools/{Path(sys.argv[0]).name}"
    try:
        import torch
    except ImportError:
        sys.exit(f"{tool}: needs torch with CUDA and a CUDA GPU; torch is not installed")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        sys.exit(f"{tool}: needs a CUDA GPU{' ' + otherwise if otherwise else ''}; "
                 f"torch {torch.__version__} ({build}) sees none here")
    if min_capability and torch.cuda.get_device_capability() < min_capability:
        major, minor = torch.cuda.get_device_capability()
        sys.exit(f"{tool}: needs an sm_{min_capability[0]}{min_capability[1]} GPU or newer; "
                 f"{torch.cuda.get_device_name()} is sm_{major}{minor}")


def sweep_path(name: str, out_dir: Path | None = None) -> Path:
    """``<out_dir>/<name>-<gpu>.json`` (out_dir default :data:`SWEEPS`), e.g.
    ``bench/results/sweeps/mla-sweep-h200.json``: where a sweep's timings go."""
    import torch

    from tilefuse.bench.runner import _slug

    return (out_dir or SWEEPS) / f"{name}-{_slug(torch.cuda.get_device_name())}.json"


def read_configs(path: str | Path | None) -> dict:
    """The file's sections ({} when ``path`` is None or the file does not exist yet)."""
    if not path or not Path(path).exists():
        return {}
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object {{family: section}}, got {type(data).__name__}")
    return data


def merge_section(configs: dict, family: str, section) -> dict:
    """``configs`` with ``section`` merged into ``configs[family]``: dict sections key by key (nested
    dicts one level deeper, as vq's), swiglu's list entry by entry (a new entry replaces the one
    with the same H, I and M)."""
    merged = dict(configs)
    old = merged.get(family)
    if isinstance(section, list):
        shape = lambda e: (e["H"], e["I"], e["M"])  # noqa: E731
        new_shapes = {shape(e) for e in section}
        merged[family] = [e for e in (old or []) if shape(e) not in new_shapes] + list(section)
    else:
        merged[family] = {**(old or {})}
        for key, value in section.items():
            both_dicts = isinstance(value, dict) and isinstance(merged[family].get(key), dict)
            merged[family][key] = {**merged[family][key], **value} if both_dicts else value
    return merged


def update_section(path: str | Path, family: str, section) -> dict:
    """Merge ``section`` into the file's ``family`` section (other families are kept); returns the file."""
    configs = merge_section(read_configs(path), family, section)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(configs, indent=1) + "\n")
    return configs


def run_with_configs(configs: dict, argv: list[str]):
    """Run ``python3 <argv>`` with ``TILEFUSE_CONFIGS`` pointing at ``configs``; its last stdout line
    is JSON and is returned (stderr passes through, for progress)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(configs, f)
    try:
        env = dict(os.environ, TILEFUSE_CONFIGS=f.name)
        done = subprocess.run([sys.executable, *argv], env=env, stdout=subprocess.PIPE, text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        os.unlink(f.name)


def parse_args(doc: str, argv: list[str] | None = None, workers: bool = True, configs: bool = True,
               min_capability: tuple[int, int] | None = None, **extra) -> argparse.Namespace:
    """``[OUT_DIR] [--configs FILE]`` plus ``extra`` options (name -> argparse kwargs), then
    :func:`require_gpu` (``min_capability``); with ``workers`` also ``--quick`` and ``--measure
    WHAT``, the worker mode of a sweep (one candidate, in its own process); ``configs=False`` for a
    sweep that picks nothing (no ``--configs``). ``args.out_dir`` is None without an OUT_DIR."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path, nargs="?", default=None, metavar="OUT_DIR",
                        help=f"where the sweep's timings go, as <name>-<gpu>.json (default {SWEEPS})")
    if configs:
        parser.add_argument("--configs", type=Path, default=None,
                            help="the TILEFUSE_CONFIGS file to start from and merge the picks into "
                                 "(default OUT_DIR/configs.json, or ./configs.json without OUT_DIR)")
    if workers:
        parser.add_argument("--quick", action="store_true", help="fewer shapes and candidates")
        parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    for name, kwargs in extra.items():
        parser.add_argument(name, **kwargs)
    args = parser.parse_args(argv)
    require_gpu(min_capability)
    if configs:
        args.configs = args.configs or (args.out_dir or Path(".")) / "configs.json"
    return args


def write_json(path: Path, data, **about) -> None:
    """``data`` under "results", beside "machine" (GPU, versions, date) and ``about`` (e.g. quick=True)."""
    import torch

    from tilefuse.bench.runner import machine_info

    head = {"machine": machine_info(torch.device("cuda")), **about}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**head, "results": data}, indent=1, default=str) + "\n")
    print(f"wrote {path}", file=sys.stderr)


class GraphRecorder:
    """Times one sweep's candidates as CUDA-graph replays (cold L2) and keeps a row per candidate in
    ``rows``: ``N``, ``K``, ``tokens``, ``impl``, ``us`` and ``rel_err`` against a reference output
    (plus the caller's fields). An output more than ``max_rel_err`` (relative) away from the
    reference gets no time, so a wrong config is never picked; one that fails to compile or launch
    gets none either (its error goes into ``rel_err``)."""

    def __init__(self, max_rel_err: float = 2e-3, rep_ms: int = 10):
        import torch

        from tilefuse.bench.harness import Timer

        self.timer = Timer(torch.device("cuda"), rep_ms=rep_ms)
        self.max_rel_err = max_rel_err
        self.rows: list[dict] = []

    def __call__(self, n: int, k: int, m: int, impl: str, fn, ref, **extra) -> float | None:
        try:
            err = float((fn().float() - ref).norm() / ref.norm())
            us = self.timer.graph_us(fn) if err < self.max_rel_err else None
        except Exception as exc:  # a config that does not compile or launch gets no time
            err, us = repr(exc)[:200], None
        self.rows.append(dict(N=n, K=k, tokens=m, impl=impl, us=us, rel_err=err, **extra))
        print(f"{n}x{k} m={m} {impl:12s} {extra.get('config', '')} {us if us is None else round(us, 2)} us",
              file=sys.stderr, flush=True)
        return us
