"""moe_ops.launch.fast on CPU, with a stand-in for a @triton.jit kernel and its compiled form (the
real path is covered on the GPU by tests/test_gpu.py, with MOE_OPS_VERIFY_LAUNCH=1 from conftest)."""
from types import SimpleNamespace

import pytest

from moe_ops.launch import fast


def _fn(a, b, C, d=None, E=3):   # parameter order is what matters
    pass


class _Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)

    def launch_metadata(self, grid, stream, *args):
        return ("meta", grid, stream, args)


class _Kernel:
    """Stands in for a JITFunction: kernel[grid](...) compiles-and-launches, returning the
    compiled kernel; run(..., warmup=True) returns what the JIT would pick."""

    def __init__(self):
        self.fn = _fn
        self.compiled = _Compiled()
        self.jit_launches = []
        self.picks = self.compiled

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.jit_launches.append((grid, args, kwargs))
            return self.compiled
        return launch

    def run(self, *args, grid, warmup, **kwargs):
        assert warmup
        return self.picks


@pytest.fixture
def hooks(monkeypatch):
    runtime = SimpleNamespace(launch_enter_hook=None, launch_exit_hook="exit-hook")
    monkeypatch.setattr(fast, "current_device", lambda: 0)
    monkeypatch.setattr(fast, "current_stream", lambda device: 77)
    monkeypatch.setattr(fast, "launch_hooks",
                        lambda: (runtime.launch_enter_hook, runtime.launch_exit_hook))
    monkeypatch.delenv("MOE_OPS_VERIFY_LAUNCH", raising=False)
    return runtime


def test_first_launch_per_key_goes_through_the_jit_then_direct(hooks):
    k = _Kernel()
    fast.FastLaunch(k, "key")[(4,)](1, 2, C=5, num_warps=4)
    assert len(k.jit_launches) == 1 and k.compiled.runs == []
    # same key: the compiled kernel's launcher, arguments in parameter order with defaults
    # filled in, launch options (num_warps) left out
    fast.FastLaunch(k, "key")[(4, 2)](7, 8, C=5, d=9, num_warps=4)
    assert k.compiled.runs == [(4, 2, 1, 77, "function", "metadata", None, None, "exit-hook",
                                7, 8, 5, 9, 3)]
    # another key: the JIT again
    fast.FastLaunch(k, "other")[(1,)](1, 2, 3)
    assert len(k.jit_launches) == 2 and len(k.compiled.runs) == 1


def test_launch_enter_hook_gets_launch_metadata(hooks):
    k = _Kernel()
    fast.FastLaunch(k, "key")[(1,)](1, 2, 3)
    hooks.launch_enter_hook = "enter-hook"
    fast.FastLaunch(k, "key")[(1,)](1, 2, 3)
    (run,) = k.compiled.runs
    assert run[6] == ("meta", (1,), 77, (1, 2, 3, None, 3)) and run[7] == "enter-hook"


def test_verify_mode_raises_when_the_jit_would_pick_another_kernel(hooks, monkeypatch):
    k = _Kernel()
    fast.FastLaunch(k, "key")[(1,)](1, 2, 3)
    monkeypatch.setenv("MOE_OPS_VERIFY_LAUNCH", "1")
    fast.FastLaunch(k, "key")[(1,)](1, 2, 3)          # the JIT agrees: launched
    assert len(k.compiled.runs) == 1
    k.picks = _Compiled()                               # a key that misses a specialisation
    with pytest.raises(RuntimeError, match="would not pick"):
        fast.FastLaunch(k, "key")[(1,)](1, 2, 3)
    assert len(k.compiled.runs) == 1                    # nothing launched


def test_compiled_kernels_per_kernel_are_bounded(hooks, monkeypatch):
    monkeypatch.setattr(fast, "MAX_KEYS", 3)
    k = _Kernel()
    for i in range(7):
        fast.FastLaunch(k, i)[(1,)](1, 2, 3)
    assert len(fast._sites[k].compiled) <= 3


def test_launch_key_adds_buffer_alignment():
    class T:
        def __init__(self, p):
            self.p = p

        def data_ptr(self):
            return self.p
    assert fast.launch_key(None, T(0)) is None
    assert fast.launch_key("k", T(512), None, T(516)) == ("k", (0, 4))


def test_missing_argument_is_a_type_error(hooks):
    k = _Kernel()
    fast.FastLaunch(k, "key")[(1,)](1, 2, 3)
    with pytest.raises(TypeError, match="missing argument 'C'"):
        fast.FastLaunch(k, "key")[(1,)](1, 2)


def test_kernel_for_uses_fast_launch_only_with_a_key_on_cuda(monkeypatch):
    import torch

    from moe_ops.launch._common import kernel_for
    k = _Kernel()
    cuda = torch.device("cuda")
    assert kernel_for(k, cuda).kernel is k and not isinstance(kernel_for(k, cuda),
                                                              fast.FastLaunch)
    assert isinstance(kernel_for(k, cuda, "key"), fast.FastLaunch)
    monkeypatch.setenv("MOE_OPS_FAST_LAUNCH", "0")
    assert kernel_for(k, cuda, "key").kernel is k
    assert not isinstance(kernel_for(k, cuda, "key"), fast.FastLaunch)


def test_every_cuda_launch_carries_the_compile_options(hooks, monkeypatch):
    """kernel_for's CUDA launchers compile with COMPILE_OPTIONS (fused multiply-adds on, which
    Triton 3.10 stops defaulting to): the fast launcher's first (JIT) launch and its verification
    pick, and the plain launcher (no key, or fast launch off); a call's own keyword wins."""
    import torch

    from moe_ops.launch import _common

    assert _common.COMPILE_OPTIONS == {"enable_fp_fusion": True}
    cuda = torch.device("cuda")
    k = _Kernel()
    _common.kernel_for(k, cuda, key="k1")[(1,)](1, 2, 3)
    assert k.jit_launches[-1][2] == {"enable_fp_fusion": True}
    seen = []
    k.run = lambda *a, grid, warmup, **kw: seen.append(kw) or k.picks
    monkeypatch.setenv("MOE_OPS_VERIFY_LAUNCH", "1")
    _common.kernel_for(k, cuda, key="k1")[(1,)](1, 2, 3, num_warps=4)
    assert seen == [{"enable_fp_fusion": True, "num_warps": 4}]
    _common.kernel_for(k, cuda)[(2,)](1, 2, 3, num_warps=8)
    assert k.jit_launches[-1] == ((2,), (1, 2, 3), {"enable_fp_fusion": True, "num_warps": 8})
    _common.kernel_for(k, cuda)[(2,)](1, 2, 3, enable_fp_fusion=False)
    assert k.jit_launches[-1][2] == {"enable_fp_fusion": False}
