"""Backend choice (environment read once, force()), cached launches, zeroed scratch, custom ops."""

import pytest
import torch

import tilefuse
from tilefuse import _env, _scratch
from tilefuse._backend import choose_backend, forced_variant


@pytest.fixture
def env(monkeypatch):
    """Set TILEFUSE_* variables for one test: tilefuse reads them once, so re-read around it."""
    def set_env(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, value)
        return _env.reload()
    yield set_env
    monkeypatch.undo()
    _env.reload()


def test_default_backend_follows_the_device(env):
    env()
    assert choose_backend(torch.device("cpu")) == "reference"
    assert choose_backend(torch.device("cuda")) == "triton"


def test_env_var_is_read_once_and_force_overrides_it(env, monkeypatch):
    env(TILEFUSE_BACKEND="reference")
    assert choose_backend(torch.device("cuda")) == "reference"
    monkeypatch.setenv("TILEFUSE_BACKEND", "triton")          # not re-read on every call
    assert choose_backend(torch.device("cuda")) == "reference"
    with tilefuse.force(backend="triton", variant="small_m"):
        assert forced_variant("swiglu") == "small_m" and forced_variant("vq") is None
        if torch.cuda.is_available() or tilefuse._backend.interpreting():
            assert choose_backend(torch.device("cpu")) == "triton"
        with tilefuse.force(variant="large_m"):
            assert forced_variant("swiglu") == "large_m"
        assert forced_variant("swiglu") == "small_m"
    assert forced_variant("swiglu") is None


def test_bad_settings_are_refused(env, tmp_path):
    with pytest.raises(ValueError, match="TILEFUSE_BACKEND: expected one of"):
        env(TILEFUSE_BACKEND="cuda-magic")
    with pytest.raises(ValueError, match="TILEFUSE_CONFIGS: expected a readable JSON file"):
        env(TILEFUSE_BACKEND="", TILEFUSE_CONFIGS=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="backend: expected one of"):
        with tilefuse.force(backend="fast"):
            pass
    with pytest.raises(ValueError, match="variant: expected one of"):
        with tilefuse.force(variant="nonexistent"):
            pass


def test_active_lists_the_variables_set(env):
    env(TILEFUSE_DEBUG="1")
    assert _env.settings.debug and _env.active()["TILEFUSE_DEBUG"] == "1"


def test_triton_on_cpu_without_interpreter_is_a_clear_error(env, monkeypatch):
    env(TILEFUSE_BACKEND="triton")
    monkeypatch.setattr(_env, "settings", _env.Settings(backend="triton", interpret=False))
    with pytest.raises(RuntimeError, match="needs CUDA tensors, or TRITON_INTERPRET=1"):
        choose_backend(torch.device("cpu"))


def test_bf16_in_the_interpreter_is_refused(interpret):
    x = torch.randn(2, 64, dtype=torch.bfloat16, device=interpret)
    w = torch.randn(128, 64, dtype=torch.bfloat16, device=interpret)
    if interpret.type == "cpu":
        with pytest.raises(ValueError, match="x: bfloat16 is not supported in Triton's CPU interpreter"):
            tilefuse.swiglu(x, w)


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


def test_scratch_pieces_are_zeroed_aligned_and_reused_in_order():
    a, b = _scratch.zeroed(torch.device("cpu"), (5, torch.float32), (3, torch.int32))
    assert a.dtype == torch.float32 and b.dtype == torch.int32 and a.numel() == 5 and b.numel() == 3
    assert not a.any() and not b.any()
    assert (b.data_ptr() - a.data_ptr()) % _scratch.ALIGN == 0 and b.data_ptr() != a.data_ptr()
    (again,) = _scratch.zeroed(torch.device("cpu"), (5, torch.float32))
    assert again.data_ptr() == a.data_ptr()       # same stream: the arena is reused (kept zero by kernels)


def test_cached_plans_match_the_first_call(interpret):
    """Later calls take the cached call plan (and, on a GPU, the direct launch): same bits as a
    call that plans from scratch; a new layout or a force() block gets a plan of its own."""
    from tilefuse.ops.swiglu import op as swiglu_op
    from tilefuse.testing.swiglu import make_case

    x, w, bias = make_case(3, 64, 96, torch.float16, interpret, bias=True)
    swiglu_op._plans.clear()
    first = tilefuse.swiglu(x, w, bias)
    assert len(swiglu_op._plans) == 1
    for _ in range(2):
        assert torch.equal(tilefuse.swiglu(x, w, bias), first)
    assert len(swiglu_op._plans) == 1
    with tilefuse.force(variant="large_m"):
        tilefuse.swiglu(x, w, bias)
    assert len(swiglu_op._plans) == 2
    swiglu_op._plans.clear()
    assert torch.equal(tilefuse.swiglu(x, w, bias), first)


def test_launcher_requires_named_constexprs():
    """The direct launch appends the trailing parameters in signature order, by name."""
    from tilefuse._launch import Kernel
    from tilefuse.ops.swiglu.kernels import swiglu_small_m_kernel

    kernel = Kernel(swiglu_small_m_kernel)
    names = swiglu_small_m_kernel.arg_names
    assert names[:6] == ["x_ptr", "w_ptr", "bias_ptr", "out_ptr", "ws_ptr", "lock_ptr"]
    assert names[-2:] == ["PROMOTE", "MASK_ROWS"] and kernel.name == "swiglu_small_m_kernel"


class _FakeCudaTensor:
    """What ``_launch.descriptor`` reads of a GPU tensor (this machine may have none)."""

    is_cuda = True

    def __init__(self, address, dtype=torch.bfloat16):
        self.address, self.dtype = address, dtype

    def data_ptr(self):
        return self.address

    def element_size(self):
        return torch.empty((), dtype=self.dtype).element_size()


def test_tma_descriptors_are_cached_by_address_and_geometry(monkeypatch):
    """A GPU buffer's descriptor is built once per (address, dtype, geometry, layout), holds no
    reference to the tensor, starts at ``offset`` elements in; a CPU tensor's (interpreter) holds
    the tensor itself."""
    from tilefuse import _launch

    monkeypatch.setattr(_launch, "_descriptors", {})
    a = _FakeCudaTensor(1 << 20)
    first = _launch.descriptor(a, [128, 64], [64, 1], [64, 64])
    assert _launch.descriptor(_FakeCudaTensor(1 << 20), (128, 64), (64, 1), (64, 64)) is first   # same bytes
    assert first.base.data_ptr() == 1 << 20 and not isinstance(first.base, _FakeCudaTensor)
    assert _launch.descriptor(a, [128, 64], [64, 1], [32, 64]) is not first                      # other box
    assert _launch.descriptor(a, [256, 64], [64, 1], [64, 64]) is not first                      # other shape
    assert _launch.descriptor(_FakeCudaTensor(1 << 20, torch.float16), [128, 64], [64, 1], [64, 64]) is not first
    shifted = _launch.descriptor(a, [128, 64], [64, 1], [64, 64], offset=512)
    assert shifted is not first and shifted.base.data_ptr() == (1 << 20) + 512 * 2
    assert len(_launch._descriptors) == 5
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    gluon = _launch.descriptor(a, [128, 64], [64, 1], [64, 64], gluon=True)      # its own entry, NVMMA layout
    assert gluon is not first and _launch.descriptor(a, [128, 64], [64, 1], [64, 64], gluon=True) is gluon
    assert gluon.layout.swizzle_byte_width == 128 and gluon.layout.element_bitwidth == 16
    assert len(_launch._descriptors) == 6
    cpu = torch.zeros(128, 64, dtype=torch.bfloat16)
    assert _launch.descriptor(cpu, [128, 64], [64, 1], [64, 64]).base is cpu and len(_launch._descriptors) == 6


def test_registry_is_the_one_family_list():
    """tilefuse/_registry.py: every family's op module has its public functions and kernel_status;
    force, the lazy exports, explain, the CLI and the benchmark runner read the same list."""
    import importlib

    import tilefuse
    from tilefuse import _backend, _registry, cli
    from tilefuse.bench import runner

    for name, family in _registry.FAMILIES.items():
        module = importlib.import_module(family.op_module)
        assert callable(module.kernel_status) and name in cli.BENCH_HELP
        # every variant force() accepts has a status line in `tilefuse info`, and no other
        assert sorted(module.kernel_status(torch.device("cpu"))) == sorted(family.variants), name
        for public in family.public:
            assert getattr(tilefuse, public) is getattr(module, public)
            assert _registry.family_of_op(public) is family
        if family.explained:
            assert callable(module.explain) and family.explained in family.public
        for other in family.also_explained:
            assert callable(getattr(module, f"explain_{other}")) and other in family.public
        assert _backend.VARIANTS[name] == family.variants
    assert runner.FAMILIES == tuple(_registry.FAMILIES)


def test_force_keyed_by_family():
    """A variant name two families share pins both unless ``family`` names one."""
    from tilefuse._backend import forced_variant

    with tilefuse.force(variant="decode"):
        assert forced_variant("vq") == forced_variant("swiglu_fp8") == "decode"
    with tilefuse.force(variant="decode", family="vq"):
        assert forced_variant("vq") == "decode" and forced_variant("swiglu_fp8") is None
        with tilefuse.force(backend="reference"):       # an inner backend pin keeps the variant pin
            assert forced_variant("vq") == "decode"
    assert forced_variant("vq") is None
    with pytest.raises(ValueError, match="family: expected one of"):
        with tilefuse.force(variant="decode", family="mlp"):
            pass
    with pytest.raises(ValueError, match="variant: expected one of"):
        with tilefuse.force(variant="large_m", family="vq"):
            pass
