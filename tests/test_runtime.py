"""Host-side helpers of moe_ops._runtime (the launchers size grids and blocks with them)."""
import inspect

import torch
import triton

from conftest import env_without_interpreter
from moe_ops._runtime import cdiv, next_pow2


def test_cdiv_matches_triton():
    for a in range(0, 3000, 7):
        for b in (1, 2, 3, 16, 64, 127, 128, 1024):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    assert cdiv(2**40 + 1, 2**20) == 2**20 + 1


def test_next_pow2_matches_triton():
    for n in range(1, 70000):
        assert next_pow2(n) == triton.next_power_of_2(n), n
    assert next_pow2(0) == 1   # a block size: never 0 (triton.next_power_of_2(0) is 0)
    assert next_pow2(2**33 + 1) == 2**34


def test_kernels_stay_compiled_after_interpreter_is_set_later():
    """`import moe_ops` decorates every kernel: a process that sets TRITON_INTERPRET=1 after the
    import (to run CPU tensors through the interpreter) keeps compiled kernels for CUDA tensors.
    Run in a child process: this test process already imported the kernels."""
    import os
    import subprocess
    import sys

    code = (
        "import os, moe_ops\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "from triton.runtime.jit import JITFunction\n"
        "from moe_ops.kernels import alignment, expert_gemm, expert_gemm_backward, routing\n"
        "ks = [getattr(m, n) for m in (alignment, expert_gemm, expert_gemm_backward, routing)\n"
        "      for n in dir(m) if n.endswith('_kernel')]\n"
        "assert len(ks) >= 10, ks\n"
        "bad = [k for k in ks if not isinstance(k, JITFunction)]\n"
        "assert not bad, bad\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_interpreted_launch_leaves_triton_language_unpatched(interpreter):
    """Triton's interpreter patches triton.language while a kernel runs, and its calls of nested
    @triton.jit helpers never undo theirs; moe_ops restores triton.language, triton.language.core
    and tl.tensor after every interpreted launch, so kernels compiled later in the process do
    not build their IR through the interpreter (the alignment's kernels call helpers)."""
    import triton.language as tl
    import triton.language.core as core

    from moe_ops.launch.alignment import align_triton

    before = [(obj, dict(vars(obj))) for obj in (tl, core, tl.tensor)]
    align_triton(torch.randint(-1, 12, (37, 3), dtype=torch.int32), 12, 16)   # the scan
    align_triton(torch.randint(-1, 64, (600, 4), dtype=torch.int32), 64, 16)  # count + place
    for obj, attrs in before:
        now = vars(obj)
        changed = sorted(k for k, v in attrs.items() if now.get(k) is not v)
        added = sorted(k for k, v in now.items() if k not in attrs and not inspect.ismodule(v))
        assert changed == [] and added == [], (obj, changed[:8], added[:8])


def test_on_device_guards_only_a_non_current_gpu(monkeypatch):
    """Kernels registered from Python get no device guard, and Triton launches on the current
    device: the ops enter the tensor's device when it is another GPU than the current one, and
    nothing (a shared no-op context) otherwise or on the CPU."""
    from moe_ops._runtime import _NO_GUARD, on_device

    class _T:   # the one attribute on_device reads
        def __init__(self, device):
            self.device = torch.device(device)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert on_device(torch.zeros(1)) is _NO_GUARD
    assert on_device(_T("cuda:0")) is _NO_GUARD
    guard = on_device(_T("cuda:1"))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert on_device(_T("cuda:1")) is _NO_GUARD


def test_works_without_transformers():
    """transformers is optional (the `hf` extra): without it `import moe_ops` registers the ops
    and they run, and apply_moe_ops() says what is missing instead of failing on an import."""
    import subprocess
    import sys

    code = """
import sys
sys.modules["transformers"] = None   # as if not installed: any import of it raises ImportError
import torch, moe_ops
from moe_ops.integrations.huggingface import apply_moe_ops
w, ids = torch.ops.moe.route(torch.randn(3, 4), 2)
out = torch.ops.moe.dispatch(torch.randn(3, 8), torch.randn(4, 12, 8), torch.randn(4, 8, 6), w, ids)
assert out.shape == (3, 8) and not out.isnan().any()
try:
    apply_moe_ops()
except ImportError as exc:
    assert "pip install 'moe_ops[hf]'" in str(exc), exc
    print("OK")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=env_without_interpreter())
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), (r.stdout[-500:], r.stderr[-800:])


def test_env_flags_read_as_triton_reads_them(monkeypatch):
    """MOE_OPS_* switches (and TRITON_INTERPRET, for moe_ops' own use) are on for the words
    Triton takes as true and off for "false", "no", "off", "0" and "" (those were once on)."""
    from moe_ops import _env
    from moe_ops._runtime import checks_enabled, interpret_enabled, recompute_enabled

    for value, on in (("1", True), ("true", True), ("YES", True), ("on", True), ("y", True),
                      ("0", False), ("false", False), ("no", False), ("off", False), ("", False),
                      ("2", False)):
        monkeypatch.setenv("MOE_OPS_RECOMPUTE", value)
        monkeypatch.setenv("MOE_OPS_CHECK", value)
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert recompute_enabled() == checks_enabled() == interpret_enabled() == on, value
        assert triton.knobs.runtime.interpret == on, value   # Triton agrees
    monkeypatch.delenv("MOE_OPS_FAST_LAUNCH", raising=False)
    assert _env.fast_launch()   # on by default
    monkeypatch.setenv("MOE_OPS_FAST_LAUNCH", "0")
    assert not _env.fast_launch()
