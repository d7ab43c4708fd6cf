"""Backend choice: env var, force(), and the custom-op path under torch.compile."""

import pytest
import torch

import tilefuse
from tilefuse._backend import ENV_VAR, choose_backend, forced_variant


def test_default_backend_follows_the_device(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert choose_backend(torch.device("cpu")) == "reference"
    assert choose_backend(torch.device("cuda")) == "triton"


def test_env_var_and_force(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "reference")
    assert choose_backend(torch.device("cuda")) == "reference"
    with tilefuse.force(backend="triton", variant="small_m"):
        assert forced_variant() == "small_m"
        if torch.cuda.is_available() or tilefuse._backend.interpreting():
            assert choose_backend(torch.device("cpu")) == "triton"
        with tilefuse.force(variant="large_m"):
            assert forced_variant() == "large_m"
        assert forced_variant() == "small_m"
    assert forced_variant() is None
    monkeypatch.setenv(ENV_VAR, "cuda-magic")
    with pytest.raises(ValueError, match=f"{ENV_VAR}: expected one of"):
        choose_backend(torch.device("cpu"))
    with pytest.raises(ValueError, match="backend: expected one of"):
        with tilefuse.force(backend="fast"):
            pass


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="needs CUDA tensors, or TRITON_INTERPRET=1"):
        choose_backend(torch.device("cpu"))


def test_public_api_is_lazy_and_complete():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        tilefuse.nope
    assert callable(tilefuse.swiglu)
    assert hasattr(torch.ops.tilefuse, "swiglu")
