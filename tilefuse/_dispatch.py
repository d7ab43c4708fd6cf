"""Dispatch shared by the families: the chip's ceilings, roofline time models, measured tables
and ``tilefuse.explain``.

Each family picks, per problem size, among its kernel variants *and the path the user had*
(``swiglu``: one cuBLAS GEMM on the merged weight + one SiLU·mul pass, variant ``"unfused"``).
The pick is made once per size and cached by the family; the order of authority is

1. ``tilefuse.force(variant=...)`` (tests, benchmarks);
2. a table measured on this GPU model by ``tilefuse tune`` (:func:`tuned_table`: the file named by
   ``TILEFUSE_CONFIGS``'s ``"tuned"`` section, else ``$XDG_CACHE_HOME/tilefuse/tuned-<gpu>.json``);
3. the family's shipped table (``configs.TUNED``: measured on an H200, cited there);
4. the cost model: every candidate's time predicted from its bytes, FLOPs and waves over the SMs
   (:func:`gemm_us`, :func:`stream_us` and the family's own kernel models), calibrated against the
   committed measurements; a kernel is picked over the baseline only with a margin
   (:data:`MARGIN_MEASURED_REGIME` where measurements cover its regime, else
   :data:`MARGIN_UNMEASURED`), since an unmeasured kernel is the risk and the baseline is not.

:func:`explain` returns the whole decision (:class:`Choice`): candidates, predicted times, the
source of the pick and why.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from pathlib import Path

import torch

# A kernel is picked over the baseline by the cost model only if predicted faster by a margin: a
# small one where the family's measurements cover the kernel's regime (the model's error there is
# known), a large one elsewhere (the model extrapolates: an unmeasured kernel is the risk, the
# baseline is not).
MARGIN_MEASURED_REGIME = 0.03
MARGIN_UNMEASURED = 0.15


@dataclasses.dataclass(frozen=True)
class Chip:
    """Ceilings of one GPU model, in the units the models use (bytes per microsecond, FLOP per
    microsecond). ``latency_us``: loaded DRAM latency (Little's law: a kernel keeps ``bandwidth x
    latency`` bytes in flight to reach the bandwidth); ``ramp_us``: the fixed cost of a
    memory-bound kernel in a CUDA graph (launch, first bytes, tail); ``source`` says where the
    figures come from."""
    name: str
    sms: int
    copy_bytes_per_us: float
    bf16_flop_per_us: float
    fp8_flop_per_us: float
    latency_us: float = 2.0
    ramp_us: float = 10.0
    source: str = ""

    @property
    def in_flight_bytes(self) -> float:
        """Bytes a kernel must keep in flight over the whole chip to reach the copy bandwidth."""
        return self.copy_bytes_per_us * self.latency_us


# H200: copy bandwidth and bf16 GEMM rate measured on one (bench/results/*-h200.json ceilings,
# 4.25 TB/s and 722-795 TFLOP/s); latency and ramp fitted to the SwiGLU decode rows of
# bench/results/swiglu-h200.json (cuBLAS's M = 1 GEMMs: bytes / bandwidth + 10 us within 15 %).
# H100 and H20: the vendors' figures scaled by the H200's measured fraction of its own (a lead,
# not a measurement: `tilefuse tune` measures where it matters).
CHIPS = {
    "H200": Chip("H200", 132, 4.25e6, 7.2e8, 1.25e9, 2.0, 10.0, "measured (bench/results)"),
    "H100": Chip("H100", 132, 2.95e6, 7.0e8, 1.2e9, 2.0, 10.0, "datasheet x the H200's measured fraction"),
    "H20": Chip("H20", 78, 3.5e6, 1.4e8, 2.8e8, 2.0, 10.0, "datasheet x the H200's measured fraction"),
}


def chip_of(name: str, sms: int) -> Chip:
    """The :class:`Chip` of a GPU named ``name`` (as CUDA reports it) with ``sms`` SMs."""
    for key, chip in CHIPS.items():
        if key in name.upper().replace("NVIDIA ", ""):
            return chip if chip.sms == sms else dataclasses.replace(chip, sms=sms)
    # an unknown GPU: the H200's per-SM rates (its picks then follow the H200's, scaled)
    base = CHIPS["H200"]
    scale = sms / base.sms
    return dataclasses.replace(base, name=name, sms=sms, copy_bytes_per_us=base.copy_bytes_per_us * scale,
                               bf16_flop_per_us=base.bf16_flop_per_us * scale,
                               fp8_flop_per_us=base.fp8_flop_per_us * scale, source="assumed: H200 per SM")


@functools.lru_cache(maxsize=None)
def chip(device: torch.device) -> Chip:
    """The ceilings of ``device``'s GPU; the H200's for a CPU (the interpreter and the CPU tests
    pick as the H200 would)."""
    if device.type != "cuda":
        return CHIPS["H200"]
    props = torch.cuda.get_device_properties(device)
    return chip_of(props.name, props.multi_processor_count)


# ------------------------------------------------------------------------------- roofline models
def waves(tiles: int, sms: int) -> int:
    return max(1, math.ceil(tiles / sms))


def stream_us(c: Chip, nbytes: float, in_flight: float | None = None) -> float:
    """A memory-bound pass over ``nbytes``: the ramp plus the bytes at the copy bandwidth, or at
    ``in_flight / latency`` where the kernel keeps fewer bytes in flight than the chip needs."""
    rate = c.copy_bytes_per_us
    if in_flight is not None:
        rate = min(rate, in_flight / c.latency_us)
    return c.ramp_us + nbytes / rate


# cuBLAS's Hopper GEMM tiles (rows x columns of the output) and their rate relative to the
# 128 x 256 one: it picks per shape, so the model takes whichever finishes first.
CUBLAS_TILES = ((128, 256, 1.0), (256, 128, 1.0), (128, 128, 0.93), (64, 256, 0.85))


def tile_fill(m: int, n: int, block_m: int, block_n: int, sms: int) -> float:
    """Useful fraction of the tensor-core work of ``[block_m, block_n]`` output tiles over an
    ``[m, n]`` output on ``sms`` SMs: the padding of the last row and column of tiles, times the
    busy fraction of the last wave (below one wave, split-K or stream-K keeps the SMs busy, so
    only the padding counts)."""
    tiles_m, tiles_n = math.ceil(m / block_m), math.ceil(n / block_n)
    padding = (m * n) / (tiles_m * block_m * tiles_n * block_n)
    tiles = tiles_m * tiles_n
    return padding * (tiles / (waves(tiles, sms) * sms) if tiles >= sms else 1.0)


def gemm_us(c: Chip, m: int, n: int, k: int, elem: int = 2, out_elem: int | None = None) -> float:
    """cuBLAS's ``[m, k] x [k, n]`` GEMM: the larger of its memory time (every operand once) and
    its compute time over whole waves of the best of :data:`CUBLAS_TILES`
    (:func:`tile_fill`)."""
    out_elem = elem if out_elem is None else out_elem
    nbytes = (m * k + n * k) * elem + m * n * out_elem
    flops = 2.0 * m * n * k
    rate = c.bf16_flop_per_us if elem >= 2 else c.fp8_flop_per_us
    fill = max(tile_fill(m, n, bm, bn, c.sms) * eff for bm, bn, eff in CUBLAS_TILES)
    return max(stream_us(c, nbytes), c.ramp_us / 2 + flops / (rate * fill))


# ------------------------------------------------------------------------------- measured tables
def tuned_path(gpu_name: str) -> Path:
    """Where ``tilefuse tune`` writes, and the dispatch reads, the table of GPU ``gpu_name``."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tilefuse"
    slug = "".join(ch if ch.isalnum() else "-" for ch in gpu_name.lower()).strip("-") or "cpu"
    return root / f"tuned-{slug}.json"


@functools.lru_cache(maxsize=None)
def tuned_table(gpu_name: str) -> dict:
    """``{family: {key: entry}}`` measured by ``tilefuse tune`` for this GPU model: the
    ``"tuned"`` section of the ``TILEFUSE_CONFIGS`` file if it has one, else :func:`tuned_path`'s
    file, else empty. Read once per process (:func:`reload_tuned` after writing one)."""
    from tilefuse import _env

    section = _env.settings.configs.get("tuned")
    if section is not None:
        return section
    path = tuned_path(gpu_name)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise RuntimeError(f"tilefuse: the tuned table {path} cannot be read ({exc}); delete it or run "
                           f"`tilefuse tune` again") from exc
    return data.get("tuned", {})


def reload_tuned() -> None:
    tuned_table.cache_clear()


def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# ------------------------------------------------------------------------------- explain
@dataclasses.dataclass(frozen=True)
class Candidate:
    """One path the dispatch weighed: its variant, config, predicted time (None where it does not
    apply) and why it does or does not apply."""
    variant: str
    config: object
    predicted_us: float | None
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Choice:
    """A family's decision for one problem: the ``variant`` and ``config`` it runs, the
    ``source`` of the decision ("forced", "tuned table <file>", "shipped table", "cost model",
    "reference"), every candidate weighed, and the problem it was made for."""
    family: str
    problem: dict
    variant: str
    config: object
    source: str
    candidates: tuple[Candidate, ...] = ()

    def __str__(self) -> str:
        lines = [f"{self.family} {self.problem}: {self.variant} ({self.source})"]
        for cand in self.candidates:
            t = "n/a" if cand.predicted_us is None else f"{cand.predicted_us:9.1f} us"
            mark = "*" if cand.variant == self.variant and cand.config == self.config else " "
            lines.append(f"  {mark} {cand.variant:<10} {t}  {cand.config if cand.config is not None else ''}"
                         f"{'  -- ' + cand.note if cand.note else ''}")
        return "\n".join(lines)


def explain(op, *args, **kwargs) -> Choice:
    """Which path ``op(*args, **kwargs)`` takes and why, without running it.

    ``op``: the public function (``tilefuse.swiglu``, ``tilefuse.swiglu_fp8``,
    ``tilefuse.vq_matmul``, ``tilefuse.vq_swiglu``, ``tilefuse.vq_moe``, ``tilefuse.flash_mla_with_kvcache``) or its
    name. SwiGLU and VQ list every candidate with its predicted time; FP8 SwiGLU and MLA report
    their measured rules (no cost model there yet).

    >>> print(tilefuse.explain(tilefuse.swiglu, x, w_gate_up))      # x: [333, 7168] on an H200
    swiglu {'M': 333, 'H': 7168, 'I': 2048, 'dtype': 'bfloat16', 'device': 'cuda:0'}: unfused (cost model)
        large_m         91.1 us  LargeMConfig(...)
      * unfused         40.4 us    -- cuBLAS GEMM on [2I, H] + one SiLU*mul pass
    """
    from tilefuse._registry import FAMILIES

    name = op if isinstance(op, str) else getattr(op, "__name__", "")
    explainers = {f.explained: (f.op_module, "explain") for f in FAMILIES.values() if f.explained}
    explainers.update({other: (f.op_module, f"explain_{other}") for f in FAMILIES.values() for other in f.also_explained})
    if name not in explainers:
        raise ValueError(f"op: expected one of {tuple(explainers)} (or the function), got {op!r}")
    import importlib

    module, function = explainers[name]
    return getattr(importlib.import_module(module), function)(*args, **kwargs)
