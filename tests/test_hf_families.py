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
    "ergo": "ungated experts",
    "jetmoe": "JetMoeParallelExperts",
    "muse_spark": "post-expert norm",
    "nemotron_h": "ungated experts",
    "nllb_moe": "NllbMoeSparseMLP",
    "switch_transformers": "SwitchTransformersSparseMLP",
    "vitpose_backbone": "VitPoseNaiveMoe",
    "deepseek_v4": "custom gating",
    "glm5_next": "custom gating",
    "hy_v4": "custom gating",
    "hy_v4_vl": "custom gating",
    "inkling2": "custom gating",
    "inkling2_loop": "custom gating",
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
