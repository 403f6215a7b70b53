import os

import pytest
import torch

import moe_ops  # noqa: F401  (registers torch.ops.moe.*)

# Per-dtype relative-error bounds against a float64 reference (||out - ref|| / ||ref||).
RTOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert not torch.isnan(out).any(), "output holds NaN (unwritten or poisoned elements)"
    denom = ref.norm().item()
    return (out - ref).norm().item() / max(denom, 1e-30)


@pytest.fixture
def interpreter(monkeypatch):
    """CPU tensors run the Triton kernels through Triton's interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture
def reference_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (GPU test: not run on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# CI sets this so Hypothesis does not flake on slow shared runners.
os.environ.setdefault("HYPOTHESIS_DEADLINE", "none")
