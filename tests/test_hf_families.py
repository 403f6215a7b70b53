"""Every MoE family of the installed transformers: `set_experts_implementation("moe_ops")` and
`apply_moe_ops(model)` give the logits of transformers' "eager" experts, or the family is refused
with an `UnsupportedModelError` whose message names the difference.

The families are read from the installed package (tests/hf_families.py), so a family added by a
later release runs here too: it fails until it works or is refused by name. Tiny float32 models on
the CPU, the ops' torch reference (not the interpreter); a few seconds in all per family."""
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_families  # noqa: E402
from conftest import OpCounter, rel_err  # noqa: E402
from moe_ops.integrations.huggingface import (  # noqa: E402
    UnsupportedModelError,
    apply_moe_ops,
    revert_moe_ops,
)

FAMILIES = hf_families.families()

# Families moe_ops refuses, with the words the refusal must contain (the difference). Anything
# not listed must work through both routes.
REFUSED = {
    "doge": "DogeCDMoE",
    "jetmoe": "JetMoeParallelExperts",
    "nllb_moe": "NllbMoeSparseMLP",
    "switch_transformers": "SwitchTransformersSparseMLP",
    "vitpose_backbone": "VitPoseNaiveMoe",
}


@pytest.fixture(autouse=True)
def _reference_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    yield
    revert_moe_ops()


def _inputs(model):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 7), generator=g)
    kw = {}
    if model.config.is_encoder_decoder:
        kw["decoder_input_ids"] = ids[:, :4]
    return ids, kw


def _out(model, ids, kw):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(ids, **kw)
    return out[0]


def _experts_modules(model):
    return [m for m in model.modules()
            if hasattr(m, "has_gate") and hasattr(type(m), "_apply_gate")
            or type(m).__name__ in ("Llama4TextExperts", "DbrxExperts")]


def _set(model, impl):
    if hf_families.uses_experts_interface(type(model).__module__.split(".")[-2]):
        model.set_experts_implementation(impl)


@pytest.mark.parametrize("fam", FAMILIES)
def test_family(fam):
    model = hf_families.build(fam)
    ids, kw = _inputs(model)
    interface = hf_families.uses_experts_interface(fam)

    if fam in REFUSED or not _experts_modules(model):
        # (a family whose experts this transformers release keeps outside the experts interface
        # is refused naming its MoE modules)
        expected = REFUSED.get(fam, "MoE-like modules .* which moe_ops does not know")
        with pytest.raises(UnsupportedModelError, match=expected):
            apply_moe_ops(model)
        assert not any("_moe_ops_saved" in m.__dict__ for m in model.modules())
        if interface:
            model.set_experts_implementation("moe_ops")
            with pytest.raises(UnsupportedModelError, match=expected):
                _out(model, ids, kw)
        return

    if interface:
        model.set_experts_implementation("eager")
    # The experts modules the input reaches (a multimodal family's vision experts stay idle on
    # text): each must become one moe.dispatch call.
    calls = []
    hooks = [m.register_forward_hook(lambda *a: calls.append(1)) for m in _experts_modules(model)]
    ref = _out(model, ids, kw)
    for h in hooks:
        h.remove()
    assert calls, f"{fam}: no experts module ran in the tiny model"
    # transformers' experts interface: experts on moe.dispatch under transformers' router
    if interface:
        model.set_experts_implementation("moe_ops")
        with OpCounter() as c:
            got = _out(model, ids, kw)
        assert c.counts.get("dispatch", 0) == len(calls), c.counts
        assert rel_err(got, ref) < 1e-5
        model.set_experts_implementation("eager")
    # apply_moe_ops: the routers on moe.route too where the family's router is listed
    apply_moe_ops(model)
    with OpCounter() as c:
        got = _out(model, ids, kw)
    assert c.counts.get("dispatch", 0) == len(calls), c.counts
    assert rel_err(got, ref) < 1e-5


# One family per router kind apply_moe_ops replaces (moe_ops/integrations/_hf_routers.py).
ROUTED = [f for f in ("mixtral", "minimax", "qwen3_next", "qwen3_vl_moe", "jamba", "granitemoe",
                      "gpt_oss", "aria", "deepseek_v2", "glm4_moe", "dots1") if f in FAMILIES]


@pytest.mark.parametrize("fam", ROUTED)
def test_router_matches_transformers(fam):
    """The moe.route forward of a listed router against transformers' own on the same module:
    the same experts per token (in any order), the same weights, logits and dtypes."""
    from moe_ops.integrations._hf_routers import original_forward, prepare, router_forward_for

    model = hf_families.build(fam)
    router = next((m for m in model.modules() if router_forward_for(m) is not None), None)
    if router is None:
        pytest.skip(f"{fam}: this transformers' router is not one moe_ops replaces")
    prepare(type(router), original_forward(router))
    hidden = torch.randn(37, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = original_forward(router)(router, hidden)
        got = router_forward_for(router)(router, hidden)
    assert len(ref) == len(got) == 3
    kinds = [("ids" if t.dtype == torch.int64 else "x") for t in ref]
    ids_i = kinds.index("ids")
    ref_ids, got_ids = ref[ids_i], got[ids_i]
    assert got_ids.dtype == torch.int64
    ref_o, got_o = ref_ids.argsort(-1), got_ids.argsort(-1)
    assert torch.equal(ref_ids.gather(1, ref_o), got_ids.gather(1, got_o))
    for i, (r, g) in enumerate(zip(ref, got)):
        if i == ids_i:
            continue
        assert r.dtype == g.dtype and r.shape == g.shape, (i, r.dtype, g.dtype, r.shape, g.shape)
        if r.shape == ref_ids.shape:  # the top-k weights, in each row's id order
            r, g = r.gather(1, ref_o), g.gather(1, got_o)
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif("dbrx" not in FAMILIES, reason="this transformers has no DBRX")
def test_dbrx_reads_its_weights_in_place():
    """DBRX's gate w1 and up v1 (two [E*I, H] parameters) and its w2 reach moe.dispatch as
    views of the parameters' storage (w13, w3 and the transposed w2), never copies; DBRX's
    router stays transformers' own; gradients reach the three parameters."""
    from moe_ops.integrations.huggingface import experts_layout

    model = hf_families.build("dbrx")
    ffn = next(m for m in model.modules() if type(m).__name__ == "DbrxFFN")
    mlp, E = ffn.experts.mlp, ffn.experts.num_experts
    I, H = ffn.experts.ffn_hidden_size, ffn.experts.hidden_size
    layout = experts_layout(ffn.experts)
    assert layout.w13.shape == (E, I, H) and layout.w3.shape == (E, I, H)
    assert layout.w2.shape == (E, H, I)
    for view, param in ((layout.w13, mlp.w1), (layout.w3, mlp.v1), (layout.w2, mlp.w2)):
        assert view.data_ptr() == param.data_ptr() and view._base is param
    assert layout.w2.stride() == (I * H, 1, H)
    params = (mlp.w1, mlp.v1, mlp.w2)
    ids, kw = _inputs(model)
    model(ids, **kw)[0].pow(2).mean().backward()          # transformers' eager experts
    ref = [p.grad.clone() for p in params]
    model.zero_grad()
    router_forward = type(ffn.router).forward
    apply_moe_ops(model)
    assert "forward" not in ffn.router.__dict__ and type(ffn.router).forward is router_forward
    with OpCounter() as c:
        model(ids, **kw)[0].pow(2).mean().backward()
    assert c.counts.get("dispatch", 0) + c.counts.get("dispatch_train", 0) == 2, c.counts
    for p, r in zip(params, ref):
        assert p.grad is not None and p.grad.shape == p.shape
        assert rel_err(p.grad, r) < 1e-5


UNGATED = [f for f in ("nemotron_h", "ergo") if f in FAMILIES]


@pytest.mark.parametrize("fam", UNGATED)
def test_ungated_relu2_experts(fam):
    """Ungated ReLU-squared experts (has_gate=False) reach moe.dispatch as ReLU gating of the up
    projection with itself: w13 and w3 are the same view of up_proj (no copy), the logits and
    the gradients of up_proj and down_proj (the two uses of up_proj add up) match transformers'
    eager experts; another activation is refused by name."""
    from moe_ops.integrations.huggingface import experts_layout

    model = hf_families.build(fam)
    ex = next(m for m in _experts_modules(model) if not m.has_gate)
    layout = experts_layout(ex)
    assert layout.w3 is layout.w13 and layout.activation == "relu"
    assert layout.w13.data_ptr() == ex.up_proj.data_ptr()
    ids, kw = _inputs(model)
    params = [m.up_proj for m in _experts_modules(model)] + [m.down_proj for m in _experts_modules(model)]
    model.set_experts_implementation("eager")
    ref_out = model(ids, **kw)[0]
    ref_out.pow(2).mean().backward()
    ref = [p.grad.clone() for p in params]
    model.zero_grad()
    apply_moe_ops(model)
    with OpCounter() as c:
        out = model(ids, **kw)[0]
        out.pow(2).mean().backward()
    assert c.counts.get("dispatch", 0) + c.counts.get("dispatch_train", 0) > 0, c.counts
    assert rel_err(out, ref_out) < 1e-5
    for p, r in zip(params, ref):
        assert p.grad is not None and rel_err(p.grad, r) < 1e-5
    revert_moe_ops(model)
    ex.act_fn = torch.nn.GELU()
    with pytest.raises(UnsupportedModelError, match="ReLU squared"):
        experts_layout(ex)


@pytest.mark.skipif("ergo" not in FAMILIES, reason="this transformers has no Ergo")
def test_subclassed_experts_forward_is_kept():
    """Ergo's ErgoExperts wraps the decorated forward (one row per route, then a per-expert
    norm): apply_moe_ops(model) keeps that forward and gives the module a config that picks
    "moe_ops"; the patched model deep-copies and pickles; revert_moe_ops puts the model's config
    object back."""
    import copy
    import pickle

    model = hf_families.build("ergo")
    ex = next(m for m in model.modules() if type(m).__name__ == "ErgoExperts")
    config = ex.config
    chosen = model.config._experts_implementation
    apply_moe_ops(model)
    assert "forward" not in ex.__dict__
    assert ex.config._experts_implementation == "moe_ops"
    assert ex.config.hidden_size == config.hidden_size
    assert model.config._experts_implementation == chosen != "moe_ops"   # the model's own config untouched
    ids, kw = _inputs(model)
    clone = copy.deepcopy(model)
    pickle.loads(pickle.dumps(clone))
    with OpCounter() as c:
        a = _out(model, ids, kw)
        b = _out(clone, ids, kw)
    assert c.counts.get("dispatch", 0) == 2 * len([m for m in _experts_modules(model)])
    assert torch.equal(a, b)
    revert_moe_ops(model)
    assert ex.config is config


CLAMPED = [f for f in ("deepseek_v4", "hy_v4", "glm5_next", "step3p7", "bailing_hybrid")
           if f in FAMILIES]


@pytest.mark.parametrize("fam", CLAMPED)
def test_clamped_silu_gates(fam):
    """A SiLU gate clamped to the module's limit, before the SiLU (DeepSeek-V4, HY-V4, GLM-5
    Next) or after it (Step-3.7, Bailing hybrid): found by probing `_apply_gate` over a range past the limit
    (here a limit of 14, beyond the probe's default reach of 12), then the experts' output and
    input gradient on pre-activations that cross the limit match transformers' eager experts."""
    from moe_ops.integrations.huggingface import experts_layout

    model = hf_families.build(fam)
    ex = next(m for m in _experts_modules(model) if hasattr(type(m), "_apply_gate"))
    # (Step-3.7's tiny config sets no limit: `limit` None, plain SiLU gating)
    name = "swiglu_limit" if hasattr(ex, "swiglu_limit") else "limit"
    setattr(ex, name, 14.0)
    layout = experts_layout(ex)
    expected = "silu_clamp_out" if fam in ("step3p7", "bailing_hybrid") else "silu_clamp"
    assert (layout.activation, layout.limit) == (expected, 14.0)
    # the largest pre-activation 3x the limit
    h = _experts_match_eager(model, ex, layout, largest=42.0, seed=3)
    assert (h.abs() > 14).float().mean() > 0.05, "the limit does not bind on these inputs"


def _experts_match_eager(model, ex, layout, largest, seed):
    """The experts module's output and input gradient through "moe_ops" against "eager" on
    random routes, the input scaled so that the largest pre-activation is `largest`; returns the
    pre-activations [T, E, 2I]."""
    g = torch.Generator().manual_seed(seed)
    T, K = 9, 2
    E = layout.w13.shape[0]
    x = torch.randn(T, layout.w13.shape[2], generator=g)
    with torch.no_grad():
        x *= largest / torch.einsum("eih,th->tei", layout.w13.float(), x).abs().max()
    x.requires_grad_(True)
    top = torch.randn(T, E, generator=g).topk(K, -1).indices
    w = torch.rand(T, K, generator=g)
    model.set_experts_implementation("eager")
    ref = ex(x, top, w)
    (gref,) = torch.autograd.grad(ref.pow(2).sum(), x)
    model.set_experts_implementation("moe_ops")
    got = ex(x, top, w)
    (ggot,) = torch.autograd.grad(got.pow(2).sum(), x)
    assert rel_err(got, ref) < 1e-5 and rel_err(ggot, gref) < 1e-5
    return torch.einsum("eih,th->tei", layout.w13.detach(), x.detach())


SOFTCAPPED = [f for f in ("inkling2", "inkling2_loop") if f in FAMILIES]


@pytest.mark.parametrize("fam", SOFTCAPPED)
def test_softcapped_swiglu_gate(fam):
    """Inkling2's softcapped SwiGLU (cg tanh(g / cg) sigmoid(g) * cu tanh(u / cu)) is found with
    the module's caps (here set to 0.5 and 0.3 so that both bend), and the experts' output and
    input gradient match transformers' eager experts."""
    from moe_ops.integrations.huggingface import experts_layout

    model = hf_families.build(fam)
    ex = next(m for m in _experts_modules(model) if hasattr(type(m), "_apply_gate"))
    ex.act_fn.gate_softcap.softcap, ex.act_fn.up_softcap.softcap = 0.5, 0.3
    layout = experts_layout(ex)
    assert (layout.activation, layout.alpha, layout.limit) == ("swiglu_softcap", 0.5, 0.3)
    # the largest pre-activation 3: both caps bend
    _experts_match_eager(model, ex, layout, largest=3.0, seed=4)


@pytest.mark.skipif("muse_spark" not in FAMILIES, reason="this transformers has no MuseSpark")
def test_post_expert_norm():
    """MuseSpark's experts norm each expert's output before the routing weight: one moe.dispatch
    over one row per route, then the norm and the weighted sum. Output and the gradients of the
    input, the weights, the routing weights and the norm's scale match transformers' eager
    experts, with a dropped route (id = E) and a token whose routes all drop."""
    model = hf_families.build("muse_spark")
    ex = next(m for m in _experts_modules(model) if getattr(m, "has_post_expert_norm", False))
    E = ex.gate_up_proj.shape[0]
    g = torch.Generator().manual_seed(6)
    T, K = 7, 2
    x = torch.randn(T, ex.gate_up_proj.shape[2], generator=g).requires_grad_(True)
    top = torch.randn(T, E, generator=g).topk(K, -1).indices
    top[1, 0] = E
    top[3] = E
    w = torch.rand(T, K, generator=g).requires_grad_(True)
    with torch.no_grad():
        ex.post_expert_norm.weight.uniform_(0.5, 1.5)
    params = [x, w, ex.gate_up_proj, ex.down_proj, ex.post_expert_norm.weight]
    results = []
    for impl in ("eager", "moe_ops"):
        model.set_experts_implementation(impl)
        with OpCounter() as c:
            out = ex(x, top, w)
        results.append((out, torch.autograd.grad(out.pow(2).sum(), params), c.counts))
    (ref, gref, _), (got, ggot, counts) = results
    assert counts.get("dispatch", 0) + counts.get("dispatch_train", 0) == 1, counts
    assert got.dtype == ref.dtype and rel_err(got, ref) < 1e-5
    assert got[3].abs().max() == 0
    for p, a, b in zip(["x", "w", "gate_up_proj", "down_proj", "norm"], ggot, gref):
        assert rel_err(a, b) < 1e-5, p
