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
    "dbrx": "two separate",
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
            or type(m).__name__ == "Llama4TextExperts"]


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
