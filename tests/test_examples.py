"""The scripts in examples/ run as a user runs them, at their tiny (CPU) sizes, in a subprocess."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TILEFUSE_BACKEND")}
    env["CUDA_VISIBLE_DEVICES"] = ""          # the CPU path, as on a machine without a GPU
    done = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_quantize_2bit_saves_reloads_and_generates(tmp_path):
    out = run_example("quantize_2bit.py", "--tiny", "--new-tokens", "6", "--out", str(tmp_path))
    assert "reloaded models give the 2-bit model's tokens: True" in out
    assert (tmp_path / "vq" / "tilefuse_vq.json").exists() and (tmp_path / "aqlm" / "config.json").exists()
    lines = {line.split("[")[0].strip(): line for line in out.splitlines() if "[" in line}
    assert {"dense", "2-bit", "save_vq -> load_vq", "save_aqlm -> load_aqlm"} <= set(lines)


def test_deepseek_mla_matches_stock_tokens():
    out = run_example("deepseek_mla.py", "--new-tokens", "6")
    assert "patch_mla: 2 attention layers" in out and "tokens equal to stock's: 12 of 12" in out
