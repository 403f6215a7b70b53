"""torch.compile, dynamic token counts, torch.export and AOTInductor for a MoE block built on
moe.route + moe.dispatch (issue 3), on CPU.

The block is what a MoE layer of Mixtral / DeepSeek-V3 does around the ops: RMSNorm, router matmul,
`moe.route`, `moe.dispatch`, residual add. The tests prove:
- `torch.compile(fullgraph=True)` traces it with zero graph breaks, forward and backward, and the
  compiled block matches eager (outputs and every gradient);
- one compiled frame serves every token count T, T=1 and T=0 included, once T is marked unbacked
  (`torch._dynamo.decorators.mark_unbacked`, in torch 2.11 and 2.13) or marked dynamic under
  `torch.fx.experimental._config.backed_size_oblivious=True` (`mark_dynamic` alone specialises
  T=1); only the second keeps Inductor's CUDA graphs (mode="reduce-overhead");
- expect tests pin the graphs Inductor compiles (post-grad FX, forward and backward) and the kernels
  its generated code launches, so a graph break, an added copy or a host sync shows up as a diff
  (regenerate with `EXPECTTEST_ACCEPT=1 python -m pytest tests/test_compile.py`);
- `torch.export` keeps `moe.route` / `moe.dispatch` as ops with a symbolic T, and the exported
  program survives save/load and AOTInductor packaging (CPU here; the GPU package is in
  test_cuda_graphs.py);
- a whole transformers Mixtral patched by `apply_moe_ops` compiles with fullgraph=True, forward and
  backward.
CPU tensors run the ops' torch reference, or Triton's interpreter under TRITON_INTERPRET=1."""
from __future__ import annotations

import functools
import io
import re
import unittest
from types import SimpleNamespace

import pytest
import torch

from conftest import needs_interpreter
from moe_block import MoEBlock
import torch._dynamo.testing
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch.fx.experimental._config as fx_config
from torch._dynamo.decorators import mark_unbacked
from torch._inductor.utils import run_and_get_code
from torch.export import Dim
from torch.torch_version import TorchVersion

import moe_ops  # noqa: F401  (registers torch.ops.moe.*)

try:  # a test dependency ([test] extra); the GPU machine may lack it
    import expecttest
except ImportError:
    expecttest = None

H, I, E, K = 32, 40, 8, 2
# Token counts visited after the first compile (at T=1): decode batch sizes, prefill lengths, none.
TOKEN_COUNTS = (1, 2, 3, 4, 7, 8, 16, 33, 64, 100, 1, 0)
# Compiled vs eager on CPU float32: Inductor's fused RMSNorm rounds differently from eager by a few
# ulps; everything downstream is the same reference code.
TOL = dict(rtol=1e-5, atol=1e-5)


def make_block(router="softmax", seed=0):
    torch.manual_seed(seed)
    return MoEBlock(H, I, E, K, router)


def make_input(T, seed, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g).requires_grad_(requires_grad)


def forward_backward(fn, block, x, mark=None):
    """Output, and the gradients of a random projection of it w.r.t. x and every parameter.
    `mark(x)` marks the leaf actually passed (dynamo's marks live on the tensor object)."""
    block.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    if mark is not None:
        mark(x)
    out = fn(x)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(out.shape[0]))
    (out * g).sum().backward()
    grads = {"x": x.grad}
    grads.update({n: p.grad for n, p in block.named_parameters()})
    return out.detach(), grads


def assert_matches_eager(compiled, block, x, mark=None):
    out, grads = forward_backward(compiled, block, x, mark)
    ref, ref_grads = forward_backward(block, block, x)
    torch.testing.assert_close(out, ref, **TOL)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **TOL, msg=lambda m: f"grad {name}: {m}")


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------
# Tracing: one graph, no breaks, forward and backward


@pytest.mark.parametrize("router", ["softmax", "deepseek"])
def test_fullgraph_forward_backward_without_graph_breaks(fresh_dynamo, router):
    block = make_block(router)
    x = make_input(8, seed=1)
    explained = torch._dynamo.explain(block)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    targets = [n.target for n in explained.graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.moe.route) + targets.count(torch.ops.moe.route.default) == 1
    assert targets.count(torch.ops.moe.dispatch) + targets.count(torch.ops.moe.dispatch.default) == 1

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    assert_matches_eager(compiled, block, x)
    assert counter.frame_count == 1


def _mark_first_compile(strategy):
    if strategy == "mark_unbacked":
        return lambda x: mark_unbacked(x, 0)
    return lambda x: torch._dynamo.mark_dynamic(x, 0)


@pytest.mark.parametrize("strategy", ["mark_unbacked", "backed_size_oblivious"])
def test_one_compiled_frame_for_every_token_count(fresh_dynamo, strategy):
    """Compiled first at T=1 (a decode step), then T changes over prefill lengths, batch sizes and
    T=0 with recompiling forbidden. Only the first input is marked: later ones need nothing."""
    block = make_block()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    oblivious = strategy == "backed_size_oblivious"
    with fx_config.patch(backed_size_oblivious=oblivious):
        assert_matches_eager(compiled, block, make_input(1, seed=0), _mark_first_compile(strategy))
        assert counter.frame_count == 1
        with torch.compiler.set_stance("fail_on_recompile"):
            for T in TOKEN_COUNTS:
                assert_matches_eager(compiled, block, make_input(T, seed=T))
    assert counter.frame_count == 1


@pytest.mark.parametrize("router", ["softmax", "deepseek"])
def test_python_api_one_frame_for_every_token_count(fresh_dynamo, router):
    """moe_ops.route / moe_ops.dispatch (which re-run the argument checks in traced Python under
    torch.compile) trace with fullgraph=True, forward and backward, in one frame for every T."""
    torch.manual_seed(0)
    block = MoEBlock(H, I, E, K, router, api="python")
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    assert_matches_eager(compiled, block, make_input(1, seed=0), lambda x: mark_unbacked(x, 0))
    with torch.compiler.set_stance("fail_on_recompile"):
        for T in TOKEN_COUNTS:
            assert_matches_eager(compiled, block, make_input(T, seed=T))
    assert counter.frame_count == 1


def _bad_dispatch_args():
    x, w2 = torch.randn(4, 8), torch.randn(3, 8, 6)
    return x, torch.randn(3, 10, 8), w2, torch.rand(4, 2), torch.zeros(4, 2, dtype=torch.int32)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: moe_ops.dispatch(*_bad_dispatch_args()), ValueError, r"w13 must have shape \[E, 2I, H\]"),
    (lambda: moe_ops.dispatch(*_bad_dispatch_args()[:2], torch.randn(3, 8, 6).double(),
                              *_bad_dispatch_args()[3:]), TypeError, "w2 must have hidden's dtype"),
    (lambda: moe_ops.route(torch.randn(4, 8), 9), ValueError, r"top_k must be in \[1, E=8\]"),
    (lambda: moe_ops.route(torch.randn(4, 8), 2, "sigmoid", True, torch.randn(7)), ValueError,
     r"bias must have shape \[E\]"),
], ids=["dispatch_shape", "dispatch_dtype", "route_top_k", "route_bias"])
def test_python_api_errors_under_compile_are_eagers(fresh_dynamo, call, exc, match):
    """Bad arguments under torch.compile: the eager exception type and message, not dynamo's
    TorchRuntimeError (which is what a direct torch.ops.moe.* call gives there); with
    fullgraph=True dynamo reports the same message as an observed exception."""
    with pytest.raises(exc, match=match):
        call()
    with pytest.raises(exc, match=match):
        torch.compile(call, backend="eager")()
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        torch.compile(call, backend="eager", fullgraph=True)()
    # The message is in the error's debug context (torch 2.11) and in its cause (2.13+).
    assert re.search(match, f"{info.value}\n{info.value.__cause__}"), str(info.value)


@pytest.mark.parametrize("strategy, cuda_graphs_allowed",
                         [("mark_unbacked", False), ("backed_size_oblivious", True)])
def test_which_strategy_keeps_inductor_cuda_graphs(fresh_dynamo, strategy, cuda_graphs_allowed):
    """Both strategies give one frame for every T, but Inductor (2.11 and 2.13, without graph
    partitioning) refuses CUDA graphs for a graph whose inputs have unbacked sizes: with
    mark_unbacked, mode="reduce-overhead" silently runs without graphs ("disabling cudagraphs due to
    incompatible op"). So CUDA graphs want backed_size_oblivious + mark_dynamic (what
    test_cuda_graphs.py uses). Checked here on the forward graph Inductor would get, with
    Inductor's own predicate."""
    find = getattr(torch._inductor.utils, "get_first_incompatible_cudagraph_node", None)
    if find is None:
        pytest.skip("this torch has no torch._inductor.utils.get_first_incompatible_cudagraph_node")
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = []

    def keep_forward(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep_forward)

    block = make_block().eval()
    with torch.no_grad(), fx_config.patch(backed_size_oblivious=strategy == "backed_size_oblivious"):
        x = make_input(8, seed=8, requires_grad=False)
        _mark_first_compile(strategy)(x)
        torch.compile(block, backend=backend, fullgraph=True)(x)
    assert len(graphs) == 1
    incompatible = find(graphs[0])
    assert (incompatible is None) == cuda_graphs_allowed, (incompatible, incompatible and incompatible.meta)


def test_mark_dynamic_alone_specialises_one(fresh_dynamo):
    """Why the strategies above: plain mark_dynamic compiled at T=8 recompiles for T=1 (0/1
    specialisation). If this starts passing without a recompile, mark_dynamic became enough."""
    block = make_block()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    x = make_input(8, seed=0)
    torch._dynamo.mark_dynamic(x, 0)
    compiled(x)
    compiled(make_input(5, seed=5))
    assert counter.frame_count == 1
    compiled(make_input(1, seed=1))
    assert counter.frame_count == 2


@needs_interpreter
def test_compiled_block_runs_triton_kernels_in_interpreter(fresh_dynamo, monkeypatch):
    """The compiled graph calls the ops, which run their Triton kernels (interpreted on CPU);
    results match the eager reference path."""
    block = make_block()
    xs = [make_input(T, seed=T, requires_grad=False) for T in (5, 1, 6)]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with torch.no_grad():
        refs = [block(x) for x in xs]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    mark_unbacked(xs[0], 0)
    with torch.no_grad():
        got = [compiled(xs[0])]
        with torch.compiler.set_stance("fail_on_recompile"):
            got += [compiled(x) for x in xs[1:]]
    for out, ref in zip(got, refs):
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------
# Inductor: the compiled graphs, pinned


def _op_name(target) -> str | None:
    if not isinstance(target, torch._ops.OpOverload):
        return None  # getitem, symbolic-size arithmetic
    name = str(target)
    return None if name.startswith("aten._assert") else name  # runtime shape asserts


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).replace("torch.", "")
        return f"{dtype}[{', '.join(str(s) for s in value.shape)}]"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    return str(value)


def render_graph(graph: torch.fx.Graph) -> str:
    """One line per aten/moe op, in order, with its output's dtype and (symbolic) shape."""
    lines = []
    for node in graph.nodes:
        if node.op == "call_function" and (name := _op_name(node.target)):
            lines.append(f"{name} -> {_describe(node.meta.get('val'))}")
    return "\n".join(lines)


def _is_backward(graph: torch.fx.Graph) -> bool:
    return any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)


_CALL = re.compile(
    r"^\s*(?:[\w, ]+ = )?(cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.[\w.]+|aten\.[\w.]+)\(")


def render_kernels(code: str) -> str:
    """The kernels and library calls of Inductor's generated `call`, in order; a host sync
    (`.item()`) is listed too."""
    body = code[code.index("def call("):]
    out = []
    for line in body.splitlines():
        if m := _CALL.match(line):
            out.append(m.group(1))
        if ".item()" in line or "_local_scalar_dense" in line:
            out.append("HOST SYNC: " + line.strip())
    return "\n".join(out)


@functools.lru_cache(maxsize=None)
def inductor_compiled_block():
    """Compiles the block with Inductor once for this module's tests: T unbacked, first call at
    T=8, forward and backward, then every T of TOKEN_COUNTS with recompiling forbidden. Records
    the post-grad graphs, the generated code and compiled/eager results. Not fullgraph, so that a
    graph break shows in the pinned graphs instead of raising."""
    torch._dynamo.reset()
    block = make_block()
    post_grad = []

    def record(graph):
        post_grad.append(("backward" if _is_backward(graph) else "forward", render_graph(graph)))

    with inductor_config.patch(post_grad_custom_post_pass=record, force_disable_caches=True), \
            functorch_config.patch(enable_autograd_cache=False):
        compiled = torch.compile(block)
        x = make_input(8, seed=8)
        _, codes = run_and_get_code(
            lambda: forward_backward(compiled, block, x, mark=lambda t: mark_unbacked(t, 0)))
        runs, error = [], None
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                for T in TOKEN_COUNTS:
                    xt = make_input(T, seed=T)
                    runs.append((T, forward_backward(compiled, block, xt),
                                 forward_backward(block, block, xt)))
        except Exception as e:  # reported by the test that needs it
            error = e
    torch._dynamo.reset()
    kernels = [("backward" if "tangents" in code else "forward", render_kernels(code)) for code in codes]
    return SimpleNamespace(post_grad=post_grad, kernels=kernels, runs=runs, error=error)


def _sections(pairs) -> str:
    return "\n".join(f"== {label}\n{text}" for label, text in pairs)


@pytest.mark.skipif(expecttest is None, reason="needs expecttest")
class TestInductorGraphs(expecttest.TestCase if expecttest else unittest.TestCase):
    def test_post_grad_graphs(self):
        """What Inductor lowers: RMSNorm and router matmul around opaque moe.route and
        moe.dispatch_train (moe.dispatch with its saved pre-activation z, [T*K, 2I]) forward;
        moe.dispatch_backward_saved plus the routing weights' softmax backward. The whole graph
        is pinned for torch 2.11 and 2.13 (the device's and CI's); torch 2.14 decomposes the
        softmax backward with one multiplication fewer, so from 2.14 on the moe ops' lines,
        their order and their shapes are pinned."""
        text = _sections(inductor_compiled_block().post_grad)
        if TorchVersion(torch.__version__) >= (2, 14):
            moe_lines = [ln for ln in text.splitlines() if ln.startswith(("==", "moe."))]
            self.assertExpectedInline("\n".join(moe_lines), """\
== forward
moe.route.default -> (float32[u0, 2], int32[u0, 2])
moe.dispatch_train.default -> (float32[u0, 32], float32[2*u0, 80])
== backward
moe.dispatch_backward_saved.default -> (float32[u0, 32], float32[8, 80, 32], float32[8, 32, 40], float32[u0, 2], float32[0], float32[0], float32[0])""")
            return
        self.assertExpectedInline(text, """\
== forward
aten.pow.Tensor_Scalar -> float32[u0, 32]
aten.mean.dim -> float32[u0, 1]
aten.add.Tensor -> float32[u0, 1]
aten.rsqrt.default -> float32[u0, 1]
aten.mul.Tensor -> float32[u0, 32]
aten.mul.Tensor -> float32[u0, 32]
aten.permute.default -> float32[32, 8]
aten.mm.default -> float32[u0, 8]
moe.route.default -> (float32[u0, 2], int32[u0, 2])
moe.dispatch_train.default -> (float32[u0, 32], float32[2*u0, 80])
aten.add.Tensor -> float32[u0, 32]
== backward
moe.dispatch_backward_saved.default -> (float32[u0, 32], float32[8, 80, 32], float32[8, 32, 40], float32[u0, 2], float32[0], float32[0], float32[0])
aten.amax.default -> float32[u0, 1]
aten.sub.Tensor -> float32[u0, 8]
aten.exp.default -> float32[u0, 8]
aten.sum.dim_IntList -> float32[u0, 1]
aten.div.Tensor -> float32[u0, 8]
prims.convert_element_type.default -> int64[u0, 2]
aten.gather.default -> float32[u0, 2]
aten.mul.Tensor -> float32[u0, 2]
aten.sum.dim_IntList -> float32[u0, 1]
aten.div.Tensor -> float32[u0, 2]
aten.mul.Tensor -> float32[u0, 2]
aten.sum.dim_IntList -> float32[u0, 1]
aten.sub.Tensor -> float32[u0, 2]
aten.div.Tensor -> float32[u0, 2]
aten.full.default -> float32[u0, 8]
aten.scatter_add.default -> float32[u0, 8]
aten.mul.Tensor -> float32[u0, 8]
aten.sum.dim_IntList -> float32[u0, 1]
aten.sub.Tensor -> float32[u0, 8]
aten.mul.Tensor -> float32[u0, 8]
aten.permute.default -> float32[8, u0]
aten.mm.default -> float32[8, 32]
aten.permute.default -> float32[32, 8]
aten.permute.default -> float32[8, 32]
aten.addmm.default -> float32[u0, 32]
aten.mul.Tensor -> float32[u0, 32]
aten.mul.Tensor -> float32[u0, 32]
aten.mul.Tensor -> float32[u0, 32]
aten.sum.dim_IntList -> float32[1, 32]
aten.reshape.default -> float32[32]
aten.mul.Tensor -> float32[u0, 32]
aten.mul.Tensor -> float32[u0, 32]
aten.sum.dim_IntList -> float32[u0, 1]
aten.add.Tensor -> float32[u0, 32]
aten.pow.Tensor_Scalar -> float32[u0, 1]
aten.mul.Scalar -> float32[u0, 1]
aten.mul.Tensor -> float32[u0, 1]
aten.expand.default -> float32[u0, 32]
aten.div.Scalar -> float32[u0, 32]
aten.pow.Tensor_Scalar -> float32[u0, 32]
aten.mul.Scalar -> float32[u0, 32]
aten.mul.Tensor -> float32[u0, 32]
aten.add.Tensor -> float32[u0, 32]""")

    def test_generated_kernels(self):
        """Inductor fuses the norm into one kernel and the residual add into another; the moe ops
        are called as they are, with no copy around them and no host sync anywhere."""
        self.assertExpectedInline(_sections(inductor_compiled_block().kernels), """\
== forward
cpp_fused_add_mean_mul_pow_rsqrt_0
extern_kernels.mm
torch.ops.moe.route.default
torch.ops.moe.dispatch_train.default
cpp_fused_add_1
== backward
torch.ops.moe.dispatch_backward_saved.default
cpp_fused__softmax__to_copy_div_gather_mul_scatter_add_sub_sum_zeros_like_0
aten.scatter_reduce_.two
cpp_fused__softmax_mul_sub_sum_1
extern_kernels.mm
extern_kernels.addmm
cpp_fused_add_div_expand_mul_pow_sum_2""")


def test_inductor_matches_eager_for_every_token_count_without_recompiling():
    run = inductor_compiled_block()
    if run.error is not None:
        raise run.error
    assert [T for T, _, _ in run.runs] == list(TOKEN_COUNTS)
    for T, (out, grads), (ref, ref_grads) in run.runs:
        torch.testing.assert_close(out, ref, **TOL, msg=lambda m: f"T={T}: {m}")
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], **TOL,
                                       msg=lambda m: f"T={T} grad {name}: {m}")


# ----------------------------------------------------------------------------------------------
# torch.export and AOTInductor


def export_block(block, T=8):
    return torch.export.export(block, (make_input(T, seed=T, requires_grad=False),),
                               dynamic_shapes=({0: Dim("T", max=1 << 20)},))


def test_export_keeps_moe_ops_with_dynamic_token_count():
    block = make_block("deepseek").eval()
    ep = export_block(block)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.moe.route.default) == 1
    assert targets.count(torch.ops.moe.dispatch.default) == 1
    x_node = [n for n in ep.graph.nodes if n.op == "placeholder"][-1]
    assert isinstance(x_node.meta["val"].shape[0], torch.SymInt)

    # The core-ATen form (what AOTInductor lowers) keeps them too: they have no decomposition.
    decomposed = ep.run_decompositions()
    ops = [_op_name(n.target) for n in decomposed.graph.nodes if n.op == "call_function"]
    assert ops.count("moe.route.default") == 1 and ops.count("moe.dispatch.default") == 1

    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    with torch.no_grad():
        for program in (ep, decomposed, loaded):
            for T in (1, 3, 17, 0):
                x = make_input(T, seed=100 + T, requires_grad=False)
                torch.testing.assert_close(program.module()(x), block(x))


@pytest.mark.slow
def test_aoti_package_runs_on_cpu(tmp_path):
    """AOTInductor compiles the block to a .pt2; the moe ops are called through its proxy executor
    (the registered kernels: here the CPU reference)."""
    block = make_block().eval()
    ep = export_block(block)
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "moe_block.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    with torch.no_grad():
        for T in (1, 8, 37):
            x = make_input(T, seed=200 + T, requires_grad=False)
            torch.testing.assert_close(runner(x), block(x), **TOL)


# ----------------------------------------------------------------------------------------------
# A whole transformers model


def _apply_moe_ops():
    pytest.importorskip("transformers")
    try:
        from moe_ops.integrations.huggingface import apply_moe_ops
    except ImportError as e:
        pytest.skip(f"moe_ops.integrations.huggingface.apply_moe_ops not available: {e}")
    return apply_moe_ops


def test_transformers_mixtral_compiles_fullgraph_forward_backward(fresh_dynamo):
    apply_moe_ops = _apply_moe_ops()
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2)
    model = apply_moe_ops(MixtralForCausalLM(config))
    ids = torch.randint(0, config.vocab_size, (2, 7))

    explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    names = [str(n.target) for n in explained.graphs[0].graph.nodes if n.op == "call_function"]
    assert sum(n.startswith("moe.route") for n in names) == config.num_hidden_layers, names
    assert sum(n.startswith("moe.dispatch") for n in names) == config.num_hidden_layers, names

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    out = compiled(input_ids=ids, labels=ids)
    out.loss.backward()
    assert counter.frame_count == 1
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ref = model(input_ids=ids, labels=ids)
    ref.loss.backward()
    torch.testing.assert_close(out.logits, ref.logits, **TOL)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m: f"grad {name}: {m}")
