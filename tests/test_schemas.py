"""The op schemas are the public contract: pinned here, and kept identical in csrc_stubs/."""
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from expecttest import TestCase

import moe_ops  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
STUB = ROOT / "csrc_stubs" / "moe_ops_stubs.cpp"


def python_schemas():
    return {name: str(getattr(torch.ops.moe, name).default._schema)
            for name in ("route", "dispatch", "dispatch_backward", "dispatch_train",
                         "dispatch_backward_saved")}


def stub_schemas():
    text = STUB.read_text()
    defs = re.findall(r'm\.def\("((?:[^"\\]|\\.)*)"\)', text)
    return {d.split("(", 1)[0]: "moe::" + d.replace('\\"', '"') for d in defs}


class TestSchemas(TestCase):
    def test_public_schemas(self):
        s = python_schemas()
        self.assertExpectedInline(s["route"], """moe::route(Tensor router_logits, int top_k, str scoring="softmax", bool renormalize=True, Tensor? bias=None, int num_groups=1, int topk_groups=1, float scale=1.) -> (Tensor topk_weights, Tensor topk_ids)""")
        self.assertExpectedInline(s["dispatch"], """moe::dispatch(Tensor hidden, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, str activation="silu", Tensor? w13_bias=None, Tensor? w2_bias=None, float alpha=1.702, float limit=7., bool gate_up_interleaved=False, bool weights_on_input=False, Tensor? w13_scale=None, Tensor? w2_scale=None, int[]? block_shape=None, bool quantize_activations=True, Tensor? w3=None, str mxfp4_layout="plain") -> Tensor""")

    def test_stubs_match_python(self):
        stubs = stub_schemas()
        py = python_schemas()
        self.assertEqual(set(stubs), set(py))
        for name in py:
            parsed = str(torch._C.parse_schema(stubs[name]))
            self.assertEqual(parsed, py[name], msg=name)


@pytest.mark.slow
def test_stub_library_loaded_first(tmp_path):
    """Build the C++ stubs, load them, then import moe_ops: the ops work on the C++ schemas."""
    cpp_extension = pytest.importorskip("torch.utils.cpp_extension")
    if not cpp_extension.is_ninja_available() or not shutil.which(os.environ.get("CXX", "c++")):
        pytest.skip("building the C++ stubs needs ninja and a C++ compiler (pip install ninja)")
    code = textwrap.dedent(f"""
        import torch
        from torch.utils.cpp_extension import load
        load(name="moe_ops_stubs", sources=[{str(STUB)!r}], build_directory={str(tmp_path)!r},
             is_python_module=False, verbose=False)
        assert torch._C._dispatch_has_kernel_for_dispatch_key("moe::route", "CPU") is False
        import moe_ops
        from moe_ops.reference import dispatch_reference
        w, ids = torch.ops.moe.route(torch.randn(5, 4), 2)
        x = torch.randn(5, 8)
        w13, w2 = torch.randn(4, 12, 8), torch.randn(4, 8, 6)
        out = torch.ops.moe.dispatch(x, w13, w2, w, ids)
        torch.testing.assert_close(out, dispatch_reference(x, w13, w2, w, ids))
        print("OK")
    """)
    env = dict(os.environ, MAX_JOBS="2")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_installed_version_is_the_package_version():
    """pyproject.toml takes the version from moe_ops.__version__ (written in one place only):
    the installed distribution reports the same string."""
    import importlib.metadata

    try:
        installed = importlib.metadata.version("moe_ops")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("moe_ops is imported from a source tree, not installed")
    assert installed == moe_ops.__version__
    assert 'dynamic = ["version"]' in (ROOT / "pyproject.toml").read_text()
