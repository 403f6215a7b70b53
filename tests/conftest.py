import functools
import os

import pytest
import torch

import moe_ops  # noqa: F401  (registers torch.ops.moe.*)
# Every kernel module is decorated now, before the `interpreter` fixture sets TRITON_INTERPRET=1:
# Triton makes a module first imported under TRITON_INTERPRET=1 interpreted for the whole
# process, and the ops import their launchers lazily (tests/test_compile_sm90.py compiles the
# real kernels and failed when it ran after tests that first imported the backward's kernels
# with the variable set).
import moe_ops.launch.dispatch_backward  # noqa: F401,E402
import moe_ops.launch.routing  # noqa: F401,E402
from moe_ops.tools.debug import OpCounter  # noqa: E402,F401  (the tests import it from here)

# Every fast launch (moe_ops.launch.fast) in the tests is checked against the kernel Triton's JIT
# would pick (CUDA only; GPU tests).
os.environ.setdefault("MOE_OPS_VERIFY_LAUNCH", "1")

# Per-dtype relative-error bounds against a float64 reference (||out - ref|| / ||ref||).
RTOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """||out - ref|| / ||ref||, or / ||scale|| where the error is relative to something else
    than the result (see `grad_errors`)."""
    out, ref = out.double(), ref.double()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert not torch.isnan(out).any(), \
        f"output holds NaN (unwritten or poisoned elements): {nan_summary(out)}"
    denom = (ref if scale is None else scale.double()).norm().item()
    return (out - ref).norm().item() / max(denom, 1e-30)


def nan_summary(t: torch.Tensor) -> str:
    """Where a tensor's NaNs are: their count, and per dimension how many indices hold one and
    the first few (unwritten output tiles show as whole blocks of rows/columns/experts)."""
    m = torch.isnan(t)
    n = int(m.sum())
    if n == 0 or t.dim() == 0:
        return f"{n} NaN"
    parts = []
    for d in range(t.dim()):
        other = [i for i in range(t.dim()) if i != d]
        hit = torch.nonzero(m.any(dim=other) if other else m).flatten()
        parts.append(f"dim {d}: {hit.numel()}/{t.shape[d]} indices, first {hit[:6].tolist()}")
    return f"{n} NaN of {t.numel()} in shape {tuple(t.shape)}; " + "; ".join(parts)


def ds_scale(grad_out, hidden, w13, w2, topk_weights, topk_ids):
    """sum_i |(dO_t W2_e)_i * a_tk,i| per slot (float64; 0 for dropped ids): the size of the
    terms of d topk_weights[t, k] = <dO_t W2_e, a_tk>. A sum's rounding error is bounded
    relative to this (|fl(sum) - sum| <= n eps sum |terms|), not to the sum, which can cancel
    to near zero. Only the last sum's terms: a wrong d topk_weights stays ~1/sqrt(I) of it."""
    T, K = topk_ids.shape
    E, I = w2.shape[0], w2.shape[2]
    ids = topk_ids.long()
    ok = ((ids >= 0) & (ids < E)).reshape(-1)
    e = ids.clamp(0, E - 1).reshape(-1)
    x = hidden.detach().double().repeat_interleave(K, dim=0)                   # [T*K, H]
    z = torch.einsum("sih,sh->si", w13.detach().double()[e], x)               # [T*K, 2I]
    a = torch.nn.functional.silu(z[:, :I]) * z[:, I:]
    dow2 = torch.einsum("sh,shi->si", grad_out.double().repeat_interleave(K, dim=0),
                        w2.detach().double()[e])                                 # [T*K, I]
    return ((dow2 * a).abs().sum(-1) * ok).view(T, K)


def grad_errors(got, ref, grad_out, args):
    """Relative errors of the gradients (hidden, w13, w2, topk_weights) of moe.dispatch against
    a float64 `ref`. d topk_weights is one dot product per slot (a single number at T = K = 1)
    that can cancel, so its error is taken relative to `ds_scale`; the other three are
    vectors or matrices of such sums, whose norm does not cancel: ||got - ref|| / ||ref||."""
    scale = ds_scale(grad_out, *args[:5])
    return ([rel_err(a, r) for a, r in zip(got[:3], ref[:3])]
            + [rel_err(got[3], ref[3], scale=scale)])


def subnormal_floor(dtype: torch.dtype, numel: int) -> float:
    """Absolute error (2-norm) a correct low-precision result may carry on top of a relative
    tolerance: a few subnormal steps of `dtype` per element. Tiny sizes (H = I = 1) with small
    weights give float16 outputs around 1e-6, where float16 has only absolute resolution
    (6e-8), so a relative bound alone would fail correct kernels."""
    fi = torch.finfo(dtype)
    return 4.0 * fi.tiny * fi.eps * max(numel, 1) ** 0.5


@pytest.fixture
def interpreter(monkeypatch):
    """CPU tensors run the Triton kernels through Triton's interpreter."""
    from moe_ops.launch._common import interpreter_works

    if not interpreter_works():
        import triton
        pytest.skip(f"triton {triton.__version__}'s interpreter cannot run the kernels here "
                    "(not run: see moe_ops.launch._common.interpreter_works)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture
def reference_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # DeepSeek-V3's float64/float32 references take up to ~60 GiB each: under pytest-xdist
        # with --dist loadgroup (benchmarks/run_gpu.sh) they all go to one worker, so two never
        # run at once (on an 80 GB H100, two side by side ran out of memory)
        big = pytest.mark.xdist_group("deepseek_memory")
        for item in items:
            if "gpu" in item.keywords and "deepseek" in item.nodeid:
                item.add_marker(big)
        return
    skip = pytest.mark.skip(reason="needs CUDA (GPU test: not run on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# CI sets this so Hypothesis does not flake on slow shared runners.
os.environ.setdefault("HYPOTHESIS_DEADLINE", "none")


def assert_same_selection(ids, ids_ref, sel_ref, tol=1e-6):
    """ids equal ids_ref, except that where the float64 selection scores of two experts are
    within `tol` (a near-tie float32 cannot resolve) either order is accepted."""
    if torch.equal(ids.cpu(), ids_ref.cpu()):
        return
    ids, ids_ref, sel_ref = ids.cpu().long(), ids_ref.cpu().long(), sel_ref.cpu().double()
    got, want = sel_ref.gather(1, ids), sel_ref.gather(1, ids_ref)
    rows = (ids != ids_ref).any(1)
    assert rows.float().mean() < 0.01, f"{int(rows.sum())} rows differ"
    assert torch.allclose(got[rows], want[rows], rtol=0, atol=tol), (got[rows], want[rows])


@functools.lru_cache(maxsize=None)
def numpy_matmul_rows_stable() -> bool:
    """Whether numpy's float32 matmul gives a row of a product the same bits whatever the number
    of rows multiplied with it. Triton's interpreter computes tl.dot with numpy, so tiles of
    different heights (half-height tails) sum bitwise alike on the CPU only where this holds:
    it did in the CI runs before 2026-12-02's, not with numpy 2.4.6 (its OpenBLAS 0.3.31: a
    16-row product differs from the first 16 rows of a 32-row one by ~1e-6). On the GPU a row's
    MMA sums never depend on the tile's height (the GPU tests assert bitwise equality there)."""
    import numpy as np

    rng = np.random.default_rng(0)
    for m, k, n in ((32, 32, 32), (32, 24, 32), (64, 40, 16)):
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        if not np.array_equal((a @ b)[: m // 2], a[: m // 2] @ b):
            return False
    return True


def assert_equal_across_tile_heights(a: torch.Tensor, b: torch.Tensor, msg=None,
                                     inputs_dtype=None) -> None:
    """a == b bitwise where the interpreter's products allow it (numpy_matmul_rows_stable), else
    within four units of the rounding of the coarser of a's dtype and `inputs_dtype` (the dtype
    the computation rounded its intermediates to: a float32 topk_weights gradient of float16
    inputs moves by float16 units when one of its float16 intermediates rounds the other way),
    relative to b's largest element as well."""
    if numpy_matmul_rows_stable():
        assert torch.equal(a, b), msg
        return
    if not a.is_floating_point():
        assert torch.equal(a, b), msg
        return
    eps = max(torch.finfo(a.dtype).eps, torch.finfo(inputs_dtype or a.dtype).eps)
    torch.testing.assert_close(a, b, rtol=4 * eps, atol=4 * eps * float(b.abs().max()),
                               msg=lambda m: f"{msg}: {m}")


def _needs_interpreter():
    from moe_ops.launch._common import interpreter_works

    return pytest.mark.skipif(not interpreter_works(),
                              reason="this Triton's interpreter cannot run the kernels (not run)")


needs_interpreter = _needs_interpreter()


def env_without_interpreter() -> dict:
    """This process's environment without TRITON_INTERPRET, for a child process (an example,
    a fresh interpreter) that must take the default path whatever fixture is active here."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def expert_counts_skewed(topk_ids, num_experts, min_skew):
    """(rows per expert of topk_ids as a list, ids < 0 or >= E dropped; whether the largest
    expert has more than min_skew times the mean rows): the weight-gradient kernel's LPT skew
    test, computed on the host."""
    ids = topk_ids.reshape(-1).long()
    counts = torch.bincount(ids[(ids >= 0) & (ids < num_experts)], minlength=num_experts).tolist()
    return counts, max(counts) * num_experts > min_skew * sum(counts)


def spy_kernel_launches(monkeypatch, module, record):
    """Replace `module.kernel_for` (a launcher module's) so that every launch runs as before and
    then calls record(kernel, grid, args, kwargs)."""
    kernel_for = module.kernel_for

    def spy(kernel, device, key=None):
        launcher = kernel_for(kernel, device, key)

        class Grid:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    out = launcher[grid](*args, **kwargs)
                    record(kernel, grid, args, kwargs)
                    return out
                return launch
        return Grid()

    monkeypatch.setattr(module, "kernel_for", spy)


@pytest.fixture(autouse=True)
def _free_gpu_memory_after_gpu_tests(request):
    """After a GPU test: drop the last failure's traceback (pytest keeps it in sys.last_*, and
    its frames hold the failed test's tensors) and return cached blocks, so that one test that
    ran out of memory does not make the next ones run out too."""
    yield
    if request.node.get_closest_marker("gpu") is None or not torch.cuda.is_initialized():
        return
    import gc
    import sys

    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()
    torch.cuda.empty_cache()
