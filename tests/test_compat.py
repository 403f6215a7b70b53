"""moe_ops._compat on the installed torch and Triton: every private API it wraps still exists and
behaves as the library expects (run by CI on each supported version; the compiled-kernel launcher
itself is exercised on the GPU by the fast-launch tests with MOE_OPS_VERIFY_LAUNCH=1)."""
import inspect

import pytest
import torch
import triton
import triton.language as tl

from moe_ops import _compat


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _kernel(x_ptr, B: tl.constexpr):
    offs = tl.arange(0, B)
    tl.store(x_ptr + offs, _twice(tl.load(x_ptr + offs)))


def test_dispatcher_keysets():
    with _compat.below_autograd():
        pass
    ks = torch._C._dispatch_keyset_full()
    below = _compat.after_autograd(ks)
    assert not below.has(torch._C.DispatchKey.AutogradCPU)
    x = torch.zeros(2, requires_grad=True)
    assert _compat.any_requires_grad(x, torch.zeros(1))
    assert not _compat.any_requires_grad(torch.zeros(1))
    assert _compat.has_schema("moe::dispatch") and _compat.has_schema("moe::route")
    assert not _compat.has_schema("moe::no_such_op")
    assert not _compat.functorch_active()
    assert _compat.forward_ad_level() < 0
    import torch.autograd.forward_ad as fwad
    with fwad.dual_level():
        assert _compat.forward_ad_level() >= 0


def test_triton_launch_api_exists():
    """The names fast launch uses: the active driver's device and stream getters, the launch
    hooks, the JIT's run(..., warmup=True), a compiled kernel's launch_metadata."""
    pytest.importorskip("triton")
    from triton import knobs
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.jit import JITFunction

    assert hasattr(knobs.runtime, "launch_enter_hook") and hasattr(knobs.runtime,
                                                                  "launch_exit_hook")
    enter, exit_hook = _compat.launch_hooks()
    assert enter is knobs.runtime.launch_enter_hook
    assert "warmup" in inspect.signature(JITFunction.run).parameters
    assert callable(getattr(CompiledKernel, "launch_metadata", None))
    for name in ("run", "function", "packed_metadata"):   # set when the kernel is loaded
        assert name in inspect.getsource(CompiledKernel), name


def test_triton_allocator_api_exists():
    pytest.importorskip("triton")
    from triton.runtime import _allocation

    assert hasattr(_allocation, "NullAllocator") and hasattr(_allocation, "_allocator")
    assert callable(_allocation._allocator.get)


def test_interpreted_launch_of_a_kernel_with_a_helper():
    """The interpreter run per call (Interpreted), a nested @triton.jit helper included, leaves
    triton.language as it found it."""
    from moe_ops.launch._common import interpreter_works

    if not interpreter_works():
        pytest.skip("this Triton's interpreter cannot run moe_ops' kernels (see interpreter_works)")
    before = dict(vars(tl))
    x = torch.arange(8, dtype=torch.float32)
    _compat.Interpreted(_kernel.fn)[(1,)](x, B=8)
    assert torch.equal(x, torch.arange(8, dtype=torch.float32) * 2)
    assert {k: v for k, v in vars(tl).items() if k in before} == before


def test_weight_desc_without_revalidation_matches_the_constructor():
    """weight_desc builds later descriptors of a block shape by copying a validated one's
    fields: they must equal what TensorDescriptor's own constructor gives."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    from moe_ops.launch._common import weight_desc

    for w in (torch.empty(4, 64, 32, dtype=torch.float16), torch.empty(2, 128, 48)):
        for block in ([1, 16, 32], [1, 32, 16]):
            for _ in range(2):
                d = weight_desc(w, block)
                ref = TensorDescriptor(w, list(w.shape), list(w.stride()), list(block))
                assert type(d) is TensorDescriptor and vars(d) == vars(ref)
    # misaligned rows: no descriptor; a zero-size dimension still raises as the constructor does
    assert weight_desc(torch.empty(2, 8, 7, dtype=torch.float16), [1, 8, 8]) is None
    with pytest.raises(AssertionError):
        weight_desc(torch.empty(0, 8, 16, dtype=torch.float16), [1, 16, 32])


def test_feature_probes_answer_on_this_triton():
    """moe_ops._features probes the installed Triton's API (not its version string alone)."""
    from moe_ops import _features

    s = _features.summary()
    assert s["triton"] == ".".join(str(int("".join(c for c in p if c.isdigit()) or 0))
                                   for p in triton.__version__.split("+")[0].split(".")[:3])
    assert s["host_tensor_descriptors"]   # Triton >= 3.6 (the oldest supported) has them
    assert s["warp_specialization_safe"] is False
    if _features.triton_version() >= (3, 7, 0):
        assert s["gluon_tma_multicast"], s
    if _features.triton_version() >= (3, 8, 0):
        assert s["gluon_hopper_tma_load"] == "async_load", s
    assert s["gluon_warp_specialize"] is True   # Gluon has it from 3.6 (the oldest supported)
    # the plain-layout MXFP4 scale prefetch: measured repeatable on 3.6 only
    assert s["mxfp4_plain_scale_prefetch_safe"] is (_features.triton_version() < (3, 7, 0))


@pytest.mark.parametrize("safe", [False, True])
def test_mxfp4_plain_prefetch_follows_the_feature(monkeypatch, safe):
    """The launcher loads the MXFP4 plain layout's scales a K step ahead only where
    _features.mxfp4_plain_scale_prefetch_safe() says the compiled loop is repeatable; the mma
    layout and FP8 keep the config's prefetch. Read from the kernels' launch arguments, as
    compiled for sm_90 (nothing runs)."""
    from moe_ops import _features
    from moe_ops.tools.compile_check import quant_launches

    monkeypatch.setattr(_features, "mxfp4_plain_scale_prefetch_safe", lambda: safe)

    def prefetch(fmt, layout="plain"):
        launches = quant_launches(fmt, (2880, 2880, 32, 4) if fmt == "mxfp4" else (1024, 384, 16, 4),
                                  128, gpt_oss=fmt == "mxfp4", mxfp4_layout=layout)
        got = {ln.name: ln.kwargs["PREFETCH_SCALES"] for ln in launches
               if "PREFETCH_SCALES" in ln.kwargs}
        assert set(got) == {"quant_gate_up_kernel", "quant_down_kernel"}, got
        return set(got.values())

    assert prefetch("mxfp4", "plain") == {safe}
    assert prefetch("mxfp4", "mma") == {True}
    assert prefetch("fp8") == {True}


def test_c10d_functional_ops_exist():
    # moe_ops.distributed's collectives (its gloo tests run them; this checks the names alone)
    ops = _compat.c10d_functional()
    for name in ("all_to_all_single", "all_reduce", "wait_tensor"):
        assert hasattr(ops, name), name
