"""Argument validation: every failure names the argument and says what was expected."""

import pytest
import torch

from tilefuse import _checks


def test_check_tensor_names_argument_and_dtype():
    with pytest.raises(ValueError, match=r"x: expected dtype float16 or bfloat16, got float32"):
        _checks.check_tensor("x", torch.zeros(2), dtypes=_checks.FLOAT16S)
    with pytest.raises(ValueError, match=r"x: expected a torch.Tensor, got list"):
        _checks.check_tensor("x", [1, 2])
    with pytest.raises(ValueError, match=r"w: expected 2 dimensions, got shape \(3,\)"):
        _checks.check_tensor("w", torch.zeros(3), ndim=2)


def test_check_shape_wildcards_and_symbolic_message():
    _checks.check_shape("w", torch.zeros(4, 8), (None, 8))
    with pytest.raises(ValueError, match=r"w: expected shape \[2I, H=16\], got \(4, 8\)"):
        _checks.check_shape("w", torch.zeros(4, 8), (None, 16), "[2I, H=16]")
    with pytest.raises(ValueError, match=r"w: expected shape \[\*, 8, 1\]"):
        _checks.check_shape("w", torch.zeros(4, 8), (None, 8, 1))


def test_check_same_device_contiguous_multiple_choice():
    a = torch.zeros(2, 2)
    assert _checks.check_same_device(a=a, b=None, c=a) == a.device
    meta = torch.zeros(2, device="meta")
    with pytest.raises(ValueError, match=r"b: expected a tensor on cpu \(like a\), got meta"):
        _checks.check_same_device(a=a, b=meta)
    with pytest.raises(ValueError, match=r"t: expected a contiguous tensor"):
        _checks.check_contiguous("t", torch.zeros(4, 4).T)
    _checks.check_contiguous("t", torch.zeros(4, 4)[:, :2], last_dim_only=True)
    with pytest.raises(ValueError, match=r"x: expected H to be a multiple of 8, got 12"):
        _checks.check_multiple("x", 12, 8, "H")
    with pytest.raises(ValueError, match=r"layout: expected one of \('a', 'b'\), got 'c'"):
        _checks.check_choice("layout", "c", ("a", "b"))


def test_dtensor_shards_are_refused_by_name(tmp_path):
    """A DTensor's data pointer is its local shard's while its shape is global: launching a kernel on
    it would read out of bounds, so every op refuses it, naming the argument."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    import tilefuse

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = DTensor.from_local(torch.randn(256, 64), mesh, [Shard(0)])
        tilefuse.swiglu(torch.randn(4, 64), weight.to_local())          # the local shard is fine
        with pytest.raises(ValueError, match="w_gate_up: expected a local tensor, got a DTensor"):
            tilefuse.swiglu(torch.randn(4, 64), weight)
    finally:
        dist.destroy_process_group()


def test_contents_unreadable_tells_real_from_meta_and_fake_tensors():
    """Real values (plain tensors, parameters, functional wrappers of real tensors) are readable;
    meta and fake tensors are not; non-tensors are ignored."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    contents_unreadable = _checks.contents_unreadable
    real = torch.ones(3)
    with FakeTensorMode():
        fake = torch.empty(3)
    assert not contents_unreadable(real, None, 3, torch.nn.Parameter(torch.ones(2)))
    assert contents_unreadable(real, torch.empty(2, device="meta"))
    assert contents_unreadable(fake, real)
    seen = []
    torch.func.functionalize(lambda x: seen.append(contents_unreadable(x)) or x)(real)
    assert seen == [False]
