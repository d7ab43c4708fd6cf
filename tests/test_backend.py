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


def test_num_sms_cpu_default_and_cached_cuda_lookup(monkeypatch):
    from types import SimpleNamespace

    from tilefuse._backend import _cuda_sm_count, num_sms

    assert num_sms(torch.device("cpu")) == 4
    assert num_sms(torch.device("cpu"), cpu_default=132) == 132
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: calls.append(index) or SimpleNamespace(multi_processor_count=100 + index))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    _cuda_sm_count.cache_clear()
    try:
        assert num_sms(torch.device("cuda", 0)) == 100
        assert num_sms(torch.device("cuda")) == 101          # no index: the current device
        assert num_sms(torch.device("cuda", 0)) == 100
        assert calls == [0, 1]                               # looked up once per device
    finally:
        _cuda_sm_count.cache_clear()
