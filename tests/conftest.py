"""Test setup shared by every test module.

* Without CUDA, ``TRITON_INTERPRET=1`` is set *before* tilefuse (and so ``@triton.jit``) is
  imported, so CPU tests can run the Triton kernels in the interpreter: use the ``interpret``
  fixture, which also forces the triton backend. Interpreter tests use fp16/fp32 only (the
  interpreter computes bf16 ``tl.dot`` from raw bits) and small shapes.
* ``@pytest.mark.gpu`` tests are skipped without CUDA; on the H200 they run with the triton backend.
* Every test gets a fresh seed derived from its node id, so inputs differ per case yet reruns repeat.
"""

import os
import zlib

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import tilefuse  # noqa: E402  (after TRITON_INTERPRET)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def interpret():
    """Run ops through the Triton kernels: interpreted on CPU, compiled on a GPU."""
    if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET was not set before tilefuse was imported")
    with tilefuse.force(backend="triton"):
        yield torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def device():
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(scope="module")
def gloo_ranks():
    """Two CPU processes joined by gloo (``tilefuse.testing.parallel.Ranks``), shared by a test
    module's two-process tests."""
    from tilefuse.testing.parallel import Ranks

    ranks = Ranks(2, "gloo", timeout=180)
    yield ranks
    ranks.close()


@pytest.fixture(scope="module")
def nccl_ranks():
    """Two processes joined by NCCL, one GPU each (``tilefuse.testing.parallel.Ranks``), shared by a
    test module's multi-GPU tests; skipped where fewer than two GPUs are visible."""
    from tilefuse.testing.parallel import Ranks

    if not (HAS_CUDA and torch.cuda.device_count() >= 2):
        pytest.skip("needs 2 CUDA GPUs")
    ranks = Ranks(2, "nccl", timeout=300)
    yield ranks
    ranks.close()
