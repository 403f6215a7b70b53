"""moe.route on the GPU: parity, strided bias, -inf and NaN logits, grouped selection."""
import os  # noqa: F401

import pytest
import torch
import triton  # noqa: F401
import triton.language as tl  # noqa: F401

from conftest import assert_same_selection, nan_summary, rel_err  # noqa: F401
from gpu_utils import (BWD_RTOL, GPU_RTOL, SHAPES, _inputs, _oracle,  # noqa: F401
                       _poison_allocator)
from moe_ops.launch.dispatch import dispatch_triton  # noqa: F401
from moe_ops.ops.samples import make_dispatch_inputs  # noqa: F401
from moe_ops.reference import dispatch_reference, route_reference  # noqa: F401
from moe_ops.reference.routing import selection_scores  # noqa: F401

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kw", [{}, {"scoring": "sigmoid", "num_groups": 8, "topk_groups": 4}])
def test_route_strided_bias_and_float64_logits(kw):
    """A bias that is a slice or an expanded scalar gives bitwise what its contiguous copy
    gives; float64 logits give bitwise what their float32 rounding gives (scored in float32)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 256, device="cuda", generator=g)
    full = torch.randn(512, device="cuda", generator=g) * 0.05
    for b in (full[1::2], torch.tensor(0.3, device="cuda").expand(256), full[7:263]):
        w, ids = torch.ops.moe.route(x, 8, bias=b, **kw)
        w_c, ids_c = torch.ops.moe.route(x, 8, bias=b.contiguous(), **kw)
        assert torch.equal(ids, ids_c) and torch.equal(w, w_c), b.stride()
    w64, ids64 = torch.ops.moe.route(x.double(), 8, **kw)
    w32, ids32 = torch.ops.moe.route(x, 8, **kw)
    assert w64.dtype == torch.float32 and torch.equal(w64, w32) and torch.equal(ids64, ids32)


@pytest.mark.parametrize("E,K,kw", [(8, 2, {}), (128, 8, {}), (64, 8, {"renormalize": False}),
                                    (256, 8, {"scoring": "sigmoid", "num_groups": 8,
                                              "topk_groups": 4, "scale": 2.5})])
@pytest.mark.parametrize("T", [1, 7, 128, 4096])
def test_route_parity(T, E, K, kw):
    g = torch.Generator(device="cuda").manual_seed(T + E)
    logits = torch.randn(T, E, device="cuda", generator=g)
    if "num_groups" in kw:
        kw = dict(kw, bias=torch.randn(E, device="cuda", generator=g) * 0.01)
    w_buf = torch.full((T, K), float("nan"), device="cuda")
    ids_buf = torch.full((T, K), -5, dtype=torch.int32, device="cuda")
    from moe_ops.launch.routing import route_triton
    route_triton(logits, K, kw.get("scoring", "softmax"), kw.get("renormalize", True),
                 kw.get("bias"), kw.get("num_groups", 1), kw.get("topk_groups", 1),
                 kw.get("scale", 1.0), out=(w_buf, ids_buf))
    w_ref, ids_ref = route_reference(logits.double(), K, **kw)
    if "bias" in kw:   # selection on s + bias: float32 s cannot resolve float64 near-ties
        _, sel = selection_scores(logits.double(), "sigmoid", kw["bias"], 8, 4)
        assert_same_selection(ids_buf, ids_ref, sel)
        same = (ids_buf == ids_ref).all(1)
        torch.testing.assert_close(w_buf[same].double(), w_ref[same], rtol=1e-5, atol=1e-6)
    else:              # selection on the logits: exact
        assert torch.equal(ids_buf, ids_ref)
        torch.testing.assert_close(w_buf.double(), w_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", [{}, {"scoring": "sigmoid", "renormalize": False}])
def test_route_minus_inf_logits_distinct_ids(kw):
    """Rows with fewer finite logits than top_k (-inf logits): distinct ids, in the reference's
    order, and the reference's weights (rows whose scores are all finite)."""
    g = torch.Generator(device="cuda").manual_seed(5)
    logits = torch.randn(300, 64, device="cuda", generator=g)
    logits[:, 3:] = torch.where(torch.rand(300, 61, device="cuda", generator=g) < 0.97,
                                float("-inf"), logits[:, 3:])
    w, ids = torch.ops.moe.route(logits, 8, **kw)
    w_ref, ids_ref = route_reference(logits.double(), 8, **kw)
    assert all(len(set(r)) == 8 for r in ids.tolist())
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w.double(), w_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", [1, 300, 5000])
def test_route_nan_logits_rank_first(T):
    """NaN logits rank first, as torch.topk ranks NaN (the kernel once ranked them last): the
    float64 reference's ids exactly and its weights, NaN where it has NaN, at one row per
    program (T <= 512) and several (T = 5000), every scoring, bias and grouping."""
    g = torch.Generator(device="cuda").manual_seed(11)
    logits = torch.randn(T, 64, device="cuda", generator=g)
    logits = logits.masked_fill(torch.rand(T, 64, device="cuda", generator=g) < 0.05, float("nan"))
    logits = logits.masked_fill(torch.rand(T, 64, device="cuda", generator=g) < 0.1, float("-inf"))
    bias = torch.randn(64, device="cuda", generator=g) * 0.1
    for kw in ({}, {"scoring": "sigmoid"}, {"scoring": "sigmoid", "bias": bias},
               {"scoring": "sigmoid", "bias": bias, "num_groups": 8, "topk_groups": 3}):
        w, ids = torch.ops.moe.route(logits, 6, **kw)
        ref_kw = {k: v.double() if torch.is_tensor(v) else v for k, v in kw.items()}
        w_ref, ids_ref = route_reference(logits.double(), 6, **ref_kw)
        assert torch.equal(ids, ids_ref), kw
        torch.testing.assert_close(w.double(), w_ref, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("T", [1, 300])
def test_route_grouped_minus_inf_bias(T):
    """Group-limited selection with -inf bias entries (fewer groups of finite score than
    topk_groups): the reference's ids and weights (the kernel once picked a chosen group
    again)."""
    g = torch.Generator(device="cuda").manual_seed(9)
    logits = torch.randn(T, 64, device="cuda", generator=g)
    bias = torch.where(torch.rand(64, device="cuda", generator=g) < 0.8, float("-inf"), 0.0)
    for groups, topk_groups in ((8, 8), (8, 6), (4, 4)):
        w, ids = torch.ops.moe.route(logits, 4, "sigmoid", True, bias, groups, topk_groups)
        w_ref, ids_ref = route_reference(logits.double(), 4, "sigmoid", True, bias.double(),
                                         groups, topk_groups)
        assert torch.equal(ids, ids_ref), (groups, topk_groups)
        torch.testing.assert_close(w.double(), w_ref, rtol=1e-5, atol=1e-6)
