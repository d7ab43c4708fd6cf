"""``compute-sanitizer --tool racecheck`` on the warp-specialized kernels and their minimal twins.

What racecheck reports on a ``gl.warp_specialize`` kernel falls in two classes:

* hazards whose both ends are code Triton emits for the warp-specialization dispatch, which the
  sanitizer attributes to the kernel's ``def`` line, its ``gl.warp_specialize(...)`` call and the
  statement after it.
  ``tilefuse.testing.racecheck.ws_handoff_kernel`` shows them with nothing else in the kernel but
  a correctly ordered hand-off (store, ``bar.sync``, release arrive; acquire wait, load), and no
  hazard at the hand-off's own loads and stores; a kernel with no shared memory at all
  (``ws_no_shared_kernel``) shows none. They are Triton's, not the kernel author's.
* anything else: a hazard at a line of the kernel's own code, to be fixed. The VQ prefill's
  codebook-peak buffer was one (read by the default partition just before
  ``gl.warp_specialize``, then overwritten by the dispatch's captured values: it is now held
  past the call), which this test would report again.

GPU only, and only where ``compute-sanitizer`` runs (it refuses gVisor machines).
"""

from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
HAZARD = re.compile(r"(Read|Write) access at (\w+)\+0x[0-9a-f]+ in ([\w.]+):(\d+)")
SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed")


def _sanitizer() -> str:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    path = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(path):
        pytest.skip("compute-sanitizer is not installed")
    return path


def _racecheck(*command: str) -> tuple[str, list[tuple[str, int]], int]:
    """(output, [(file, line) of every hazard end], hazards displayed) of one run under racecheck."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([_sanitizer(), "--tool", "racecheck", "--print-limit", "50", sys.executable, *command],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    out = done.stdout + done.stderr
    if "Device not supported" in out:
        pytest.skip("compute-sanitizer does not support this machine's GPU runtime")
    summary = SUMMARY.search(out)
    assert done.returncode == 0 and summary, out[-3000:]
    return out, [(m.group(3), int(m.group(4))) for m in HAZARD.finditer(out)], int(summary.group(1))


def _dispatch_lines(kernel) -> set[tuple[str, int]]:
    """The (file, line) pairs racecheck gives to Triton's dispatch code: the ``def`` line, every line
    of each ``gl.warp_specialize(...)`` call and the statement after it (the region's exit)."""
    fn = getattr(kernel, "fn", kernel)
    lines, first = inspect.getsourcelines(fn)
    name = Path(inspect.getsourcefile(fn)).name
    found = {first + next(i for i, text in enumerate(lines) if text.lstrip().startswith("def "))}
    for i, text in enumerate(lines):
        if "gl.warp_specialize(" in text:
            depth, j = 0, i
            while True:
                depth += lines[j].count("(") + lines[j].count("[") - lines[j].count(")") - lines[j].count("]")
                found.add(first + j)
                if depth <= 0:
                    break
                j += 1
            # the region's exit code is given to the statement after the call, or to the last of
            # the ``_keep_alive()`` markers that follow it (they emit no code of their own)
            statements = [k for k in range(j + 1, len(lines)) if lines[k].strip()
                          and not lines[k].lstrip().startswith("#")]
            for n, k in enumerate(statements):
                found.add(first + k)
                if n + 1 == len(statements) or "_keep_alive()" not in lines[statements[n + 1]]:
                    break
    return {(name, line) for line in found}


def test_no_shared_memory_no_hazard():
    out, ends, shown = _racecheck("-m", "tilefuse.testing.racecheck", "no_shared")
    assert "output right" in out and shown == 0, out[-3000:]


def test_ordered_handoff_reports_only_the_dispatch():
    """The hand-off's own store (``_write_tile``) and load (``_read_tile``) are never flagged."""
    from tilefuse.testing.racecheck import ws_handoff_kernel

    out, ends, shown = _racecheck("-m", "tilefuse.testing.racecheck", "handoff")
    assert "output right" in out, out[-3000:]
    assert set(ends) <= _dispatch_lines(ws_handoff_kernel), ends


def test_vq_prefill_ws_reports_only_the_dispatch():
    from tilefuse.ops.vq.kernels_prefill import vq_prefill_ws_kernel

    out, ends, shown = _racecheck("tools/sanitize.py", "--one", "--only", "vq prefill wgmma ws=1")
    assert "1 cases ran" in out, out[-3000:]
    assert set(ends) <= _dispatch_lines(vq_prefill_ws_kernel), ends


@pytest.mark.xfail(reason="racecheck flags the softmax -> PV hand-offs of P's row factors and sums (docs/mla.md); the "
                          "minimal ordered hand-off is not flagged, so these are not shown to be artifacts",
                   strict=False)
def test_mla_ws_reports_only_the_dispatch():
    from tilefuse.ops.mla.kernels_gluon import mla_split_ws_kernel

    out, ends, shown = _racecheck("tools/sanitize.py", "--one", "--only", "mla h16 wgmma")
    assert set(ends) <= _dispatch_lines(mla_split_ws_kernel), ends
