"""transformers integration: apply_moe_ops / revert_moe_ops on tiny random Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE and DeepSeek-V3 models, and the "moe_ops" experts implementation.

Every model is built from a config (nothing is downloaded) and is small enough for a few seconds
per test on two CPU cores. CPU tensors run the ops' torch reference; the GPU variants (bf16 on CUDA,
Triton kernels) are marked `gpu`."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")


from conftest import OpCounter, needs_interpreter, rel_err  # noqa: E402
from moe_ops.integrations import huggingface as hf  # noqa: E402
from moe_ops.integrations.huggingface import (  # noqa: E402
    UnsupportedModelError,
    apply_moe_ops,
    is_patched,
    register_experts_interface,
    revert_moe_ops,
)

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM, MixtralConfig(intermediate_size=96, num_local_experts=4,
                                             num_experts_per_tok=2, **COMMON)


def _qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM, Qwen2MoeConfig(
        intermediate_size=96, moe_intermediate_size=48, shared_expert_intermediate_size=80,
        num_experts=6, num_experts_per_tok=2, norm_topk_prob=False, **COMMON)


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM, Qwen3MoeConfig(
        intermediate_size=96, moe_intermediate_size=48, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=True, head_dim=16, **COMMON)


def _olmoe():
    from transformers import OlmoeConfig, OlmoeForCausalLM

    return OlmoeForCausalLM, OlmoeConfig(intermediate_size=48, num_experts=6, num_experts_per_tok=2,
                                         norm_topk_prob=False, **COMMON)


def _deepseek_v3(**over):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    kw = dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
              num_experts_per_tok=3, n_group=4, topk_group=2, norm_topk_prob=True,
              first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
              kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16,
              qk_nope_head_dim=8, **{**COMMON, "num_key_value_heads": 4})
    kw.update(over)
    return DeepseekV3ForCausalLM, DeepseekV3Config(**kw)


FAMILIES = {
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "olmoe": _olmoe,
    "deepseek_v3": _deepseek_v3,
    # no groups, no renormalisation, scale 1: the other DeepSeek-V3 router branch
    "deepseek_v3_flat": lambda: _deepseek_v3(n_group=1, topk_group=1, norm_topk_prob=False,
                                             routed_scaling_factor=1.0),
}
# The families whose router logits transformers records for the auxiliary loss (all of them in
# transformers >= 5.2x; DeepSeek-V3 in 5.17 records none).
NAMES = list(FAMILIES)


def make_model(name, dtype=torch.float32, device="cpu", seed=0, **config_over):
    cls, config = FAMILIES[name](**config_over)
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.normal_(0.0, 0.3)  # make the selection bias matter
    return model.to(device=device, dtype=dtype).eval()


def input_ids(batch=2, seq=9, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, seq), generator=g).to(device)


def num_moe_blocks(model):
    return sum(1 for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate"))


def assert_pristine(model):
    """No instance attribute left behind by apply_moe_ops."""
    for m in model.modules():
        assert "_moe_ops_saved" not in m.__dict__
        assert "forward" not in m.__dict__, type(m).__name__


@pytest.fixture(autouse=True)
def _reference_path_and_no_leaks(monkeypatch):
    # CPU tests run the ops' torch reference (fast) unless a test asks for the interpreter.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    yield
    revert_moe_ops()  # a failing class-route test must not leak into the others


# ------------------------------------------------------------------------------------------------
# Instance route


@pytest.mark.parametrize("name", NAMES)
def test_logits_match(name):
    model = make_model(name)
    ids = input_ids()
    with torch.no_grad():
        ref = model(ids).logits
        assert apply_moe_ops(model) is model
        with OpCounter() as c:
            out = model(ids).logits
    blocks = num_moe_blocks(model)
    assert blocks >= 1
    assert c.counts == {"route": blocks, "dispatch": blocks}
    assert rel_err(out, ref) < 1e-5


def _assert_interpreted_logits_match(model, monkeypatch):
    """apply_moe_ops(model) run through Triton's interpreter gives the unpatched model's logits."""
    ids = input_ids(batch=1, seq=6)
    with torch.no_grad():
        ref = model(ids).logits
        apply_moe_ops(model)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        out = model(ids).logits
    assert rel_err(out, ref) < 1e-5


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="CPU-only check: with triton 3.6 on a CUDA machine, an interpreted launch "
                           "fails and breaks the CUDA launches after it in the process")
@needs_interpreter
@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3"])
def test_logits_match_triton_interpreter(name, monkeypatch):
    """The same through the Triton kernels (run by Triton's interpreter on CPU)."""
    _assert_interpreted_logits_match(make_model(name), monkeypatch)


@pytest.mark.parametrize("name", NAMES)
def test_router_matches_transformers(name):
    """The patched router against transformers' own on the same weights: same experts, same
    weights (each row's ids may come in another order), same logits."""
    model = make_model(name)
    block = next(m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate"))
    router = block.gate
    hidden = torch.randn(33, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref_logits, ref_w, ref_ids = router(hidden)
        apply_moe_ops(model)
        logits, w, ids = router(hidden)
    assert torch.equal(logits, ref_logits)
    assert w.dtype == ref_w.dtype and w.shape == ref_w.shape
    ref_order = ref_ids.argsort(dim=-1)
    order = ids.long().argsort(dim=-1)
    assert torch.equal(ids.long().gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", NAMES)
def test_generate_matches(name):
    model = make_model(name)
    ids = input_ids(batch=1, seq=5)
    kw = dict(max_new_tokens=8, do_sample=False, min_new_tokens=8)
    ref = model.generate(ids, **kw)
    apply_moe_ops(model)
    out = model.generate(ids, **kw)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_export_patched_model(name):
    """torch.export of a whole patched model (what transformers' export tests do, non-strict):
    moe.route / moe.dispatch stay ops in the exported graph, whose logits equal the eager
    patched model's, at the traced batch and at another sequence length (dynamic)."""
    from torch.export import Dim

    model = apply_moe_ops(make_model(name)).eval()
    ids = input_ids(batch=2, seq=7)
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
    ep = torch.export.export(model, (ids,), {"use_cache": False}, strict=False,
                             dynamic_shapes={"input_ids": {1: Dim("seq", min=2, max=64)},
                                             "use_cache": None})
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any("moe.dispatch" in t for t in targets), sorted(targets)[:20]
    out = ep.module()(ids, use_cache=False).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    ids11 = input_ids(batch=2, seq=11, seed=4)
    with torch.no_grad():
        ref11 = model(ids11, use_cache=False).logits
    torch.testing.assert_close(ep.module()(ids11, use_cache=False).logits, ref11, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3"])
def test_generate_static_cache(name):
    model = make_model(name)
    ids = input_ids(batch=2, seq=5)
    kw = dict(max_new_tokens=6, do_sample=False, min_new_tokens=6, cache_implementation="static")
    ref = model.generate(ids, **kw)
    apply_moe_ops(model)
    out = model.generate(ids, **kw)
    assert torch.equal(out, ref)


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", NAMES)
def test_training_step_gradients(name):
    ref_model = make_model(name).train()
    model = apply_moe_ops(copy.deepcopy(ref_model))
    ids = input_ids()
    aux = hasattr(ref_model.config, "output_router_logits")
    kw = dict(labels=ids, output_router_logits=True) if aux else dict(labels=ids)
    ref_out = ref_model(ids, **kw)
    with OpCounter() as c:
        out = model(ids, **kw)
        out.loss.backward()
    ref_out.loss.backward()
    assert c.counts.get("dispatch_backward_saved", 0) == num_moe_blocks(model)
    assert rel_err(out.loss, ref_out.loss) < 1e-5
    if getattr(ref_out, "aux_loss", None) is not None:
        assert rel_err(out.aux_loss, ref_out.aux_loss) < 1e-5
    ref_grads, grads = _grads(ref_model), _grads(model)
    routers = [n for n in grads if ".gate.weight" in n or n.endswith("gate.weight")]
    assert routers, "no router parameter found"
    for n, g in ref_grads.items():
        if g is None:
            assert grads[n] is None, n
            continue
        assert grads[n] is not None, f"{n}: no gradient through moe_ops"
        assert rel_err(grads[n], g) < 1e-5, n
    for n in routers:
        assert grads[n].abs().sum() > 0, f"{n}: zero router gradient"
    # ... and the step itself
    for m in (ref_model, model):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    with torch.no_grad():
        assert rel_err(model(ids).logits, ref_model(ids).logits) < 1e-5


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "olmoe"])
def test_router_logits_recorded(name):
    """output_router_logits=True still records the router logits (hooks on the router module):
    the first layer's bitwise (the same router on the same input), later layers' within float32
    rounding (their input went through the previous layer's experts, moe_ops' against
    transformers': with transformers 5.24 those differ in the last bits, ~1e-7)."""
    model = make_model(name)
    ids = input_ids()
    with torch.no_grad():
        ref = model(ids, output_router_logits=True).router_logits
        apply_moe_ops(model)
        out = model(ids, output_router_logits=True).router_logits
    assert len(out) == len(ref) > 1
    assert torch.equal(out[0], ref[0])
    for a, b in zip(out[1:], ref[1:]):
        assert a.shape == b.shape and rel_err(a, b) < 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_revert_restores(name):
    model = make_model(name)
    ids = input_ids()
    with torch.no_grad():
        ref = model(ids).logits
        apply_moe_ops(model)
        assert is_patched(model)
        assert revert_moe_ops(model) is model
        assert not is_patched(model)
        assert_pristine(model)
        with OpCounter() as c:
            out = model(ids).logits
    assert c.counts == {}
    assert torch.equal(out, ref)


def test_patch_twice_harmless():
    model = make_model("qwen2_moe")
    ids = input_ids()
    with torch.no_grad():
        ref = model(ids).logits
        apply_moe_ops(model)
        once = model(ids).logits
        apply_moe_ops(model)
        with OpCounter() as c:
            twice = model(ids).logits
        assert c.counts == {"route": 2, "dispatch": 2}
        assert torch.equal(once, twice)
        revert_moe_ops(model)  # one revert undoes both
        assert_pristine(model)
        assert torch.equal(model(ids).logits, ref)
        revert_moe_ops(model)  # reverting again does nothing
        assert_pristine(model)


def test_deepseek_dense_layers_untouched():
    model = make_model("deepseek_v3")
    apply_moe_ops(model)
    layers = model.model.layers
    assert type(layers[0].mlp).__name__ == "DeepseekV3MLP"
    assert not any("_moe_ops_saved" in m.__dict__ for m in layers[0].modules())
    assert "_moe_ops_saved" in layers[1].mlp.gate.__dict__
    assert "_moe_ops_saved" in layers[1].mlp.experts.__dict__
    assert "_moe_ops_saved" not in layers[1].mlp.shared_experts.__dict__


def test_zero_copy():
    """The ops read the model's own expert tensors: an in-place change shows up."""
    model = apply_moe_ops(make_model("mixtral"))
    ids = input_ids()
    with torch.no_grad():
        before = model(ids).logits
        for layer in model.model.layers:
            layer.mlp.experts.down_proj.mul_(2.0)
        after = model(ids).logits
    assert not torch.allclose(before, after)


def test_deepcopy_of_patched_model():
    model = apply_moe_ops(make_model("olmoe"))
    clone = copy.deepcopy(model)
    ids = input_ids()
    with torch.no_grad():
        with torch.no_grad():
            clone.model.layers[0].mlp.experts.down_proj.zero_()
        assert not torch.equal(clone(ids).logits, model(ids).logits)
    assert is_patched(clone)
    revert_moe_ops(clone)
    assert_pristine(clone)
    assert is_patched(model)


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3"])
def test_patched_model_survives_torch_save_and_load(name, tmp_path):
    """torch.save / torch.load (pickle) of a patched model: the loaded copy is still patched,
    gives the same logits, runs the moe ops, and can be reverted."""
    model = apply_moe_ops(make_model(name))
    path = tmp_path / "model.pt"
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    ids = input_ids()
    assert is_patched(loaded)
    with torch.no_grad(), OpCounter() as counter:
        got = loaded(ids).logits
    blocks = num_moe_blocks(loaded)
    assert counter.counts == {"route": blocks, "dispatch": blocks}, counter.counts
    with torch.no_grad():
        assert torch.equal(got, model(ids).logits)
    revert_moe_ops(loaded)
    assert_pristine(loaded)


# ------------------------------------------------------------------------------------------------
# accelerate hooks (device_map / offloading wrap a module's forward)


def _counting_hook():
    hooks = pytest.importorskip("accelerate.hooks")

    class Counting(hooks.ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            self.calls += 1
            return args, kwargs

    return hooks, Counting()


def _experts_modules(model):
    return [m.mlp.experts for m in model.model.layers if hasattr(m.mlp, "experts")]


def _run(model, ids):
    with torch.no_grad(), OpCounter() as counter:
        out = model(ids).logits
    return out, counter.counts


def _hook_case(name):
    """(accelerate.hooks, a counting hook, an unpatched model, its input ids, its logits)."""
    hooks, hook = _counting_hook()
    model = make_model(name)
    ids = input_ids()
    ref, _ = _run(model, ids)
    return hooks, hook, model, ids, ref


@pytest.mark.parametrize("hook_first", [True, False], ids=["hook_then_patch", "patch_then_hook"])
def test_accelerate_hook_survives_patch_and_revert(hook_first):
    """An accelerate hook on an experts module, added before or after apply_moe_ops: the hook
    runs while patched and still runs after revert_moe_ops, which restores the original
    experts forward under it."""
    hooks, hook, model, ids, ref = _hook_case("qwen3_moe")
    experts = _experts_modules(model)[0]
    if hook_first:
        hooks.add_hook_to_module(experts, hook)
    apply_moe_ops(model)
    if not hook_first:
        hooks.add_hook_to_module(experts, hook)
    out, counts = _run(model, ids)
    blocks = num_moe_blocks(model)
    assert counts == {"route": blocks, "dispatch": blocks}
    assert hook.calls == 1
    assert rel_err(out, ref) < 1e-5
    revert_moe_ops(model)
    assert not is_patched(model)
    out, counts = _run(model, ids)
    assert counts == {}, "revert_moe_ops left the patch in place under the hook"
    assert hook.calls == 2, "revert_moe_ops dropped the accelerate hook"
    assert torch.equal(out, ref)
    hooks.remove_hook_from_module(experts)
    out, counts = _run(model, ids)
    assert counts == {} and hook.calls == 2 and torch.equal(out, ref)


def test_accelerate_hook_removed_while_patched():
    """Patched under a hook, then the hook removed (accelerate moves the patched forward back to
    `forward`): the model stays patched, and revert_moe_ops then unpatches it."""
    hooks, hook, model, ids, ref = _hook_case("olmoe")
    for experts in _experts_modules(model):
        hooks.add_hook_to_module(experts, hook)
    apply_moe_ops(model)
    for experts in _experts_modules(model):
        hooks.remove_hook_from_module(experts)
    blocks = num_moe_blocks(model)
    out, counts = _run(model, ids)
    assert counts == {"route": blocks, "dispatch": blocks} and hook.calls == 0
    revert_moe_ops(model)
    out, counts = _run(model, ids)
    assert counts == {}, "revert_moe_ops left the patch in place after the hook was removed"
    assert torch.equal(out, ref)
    assert_pristine(model)


def test_apply_after_accelerate_hook_removed():
    """accelerate's remove_hook_from_module leaves the class forward, bound, as an instance
    attribute: that is not another library's wrapper, and apply_moe_ops patches over it (and
    revert puts it back)."""
    hooks, hook, model, ids, ref = _hook_case("mixtral")
    for experts in _experts_modules(model):
        hooks.add_hook_to_module(experts, hook)
        hooks.remove_hook_from_module(experts)
        assert "forward" in experts.__dict__  # what accelerate leaves behind
    apply_moe_ops(model)
    blocks = num_moe_blocks(model)
    out, counts = _run(model, ids)
    assert counts == {"route": blocks, "dispatch": blocks}
    assert rel_err(out, ref) < 1e-5
    revert_moe_ops(model)
    out, counts = _run(model, ids)
    assert counts == {} and torch.equal(out, ref)


# ------------------------------------------------------------------------------------------------
# Class route


def test_class_route():
    ref_model = make_model("qwen3_moe")
    ids = input_ids()
    from transformers.models.qwen3_moe import modeling_qwen3_moe as mod

    router_fwd = mod.Qwen3MoeTopKRouter.__dict__["forward"]
    experts_fwd = mod.Qwen3MoeExperts.__dict__["forward"]
    with torch.no_grad():
        ref = ref_model(ids).logits
        try:
            assert apply_moe_ops() is None
            apply_moe_ops()  # twice: harmless
            assert is_patched()
            model = make_model("qwen3_moe")  # built afterwards, same seed, same weights
            with OpCounter() as c:
                out = model(ids).logits
            assert c.counts == {"route": 2, "dispatch": 2}
            assert rel_err(out, ref) < 1e-5
            assert_pristine(model)  # the classes carry the patch, not the instance
            # the instance route on top of the class route is harmless too
            apply_moe_ops(model)
            assert rel_err(model(ids).logits, ref) < 1e-5
            revert_moe_ops(model)
        finally:
            revert_moe_ops()
        assert not is_patched()
        assert mod.Qwen3MoeTopKRouter.__dict__["forward"] is router_fwd
        assert mod.Qwen3MoeExperts.__dict__["forward"] is experts_fwd
        with OpCounter() as c:
            again = model(ids).logits
        assert c.counts == {}
        assert torch.equal(again, ref)


def test_class_route_trains():
    ref_model = make_model("mixtral").train()
    ids = input_ids()
    try:
        apply_moe_ops()
        model = make_model("mixtral").train()
        model(ids, labels=ids).loss.backward()
    finally:
        revert_moe_ops()
    ref_model(ids, labels=ids).loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert rel_err(p.grad, q.grad) < 1e-5, n


# ------------------------------------------------------------------------------------------------
# ExpertsInterface route


def test_experts_interface_registered():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert "moe_ops" in ALL_EXPERTS_FUNCTIONS
    assert ALL_EXPERTS_FUNCTIONS["moe_ops"] is hf.moe_ops_experts_forward
    assert register_experts_interface() is True  # idempotent
    assert register_experts_interface() is True
    assert ALL_EXPERTS_FUNCTIONS["moe_ops"] is hf.moe_ops_experts_forward


@pytest.mark.parametrize("name", NAMES)
def test_experts_interface(name):
    model = make_model(name)
    ids = input_ids()
    with torch.no_grad():
        ref = model(ids).logits
        model.set_experts_implementation("moe_ops")
        with OpCounter() as c:
            out = model(ids).logits
    assert c.counts == {"dispatch": num_moe_blocks(model)}  # transformers' own router
    assert rel_err(out, ref) < 1e-5
    gen_ref = make_model(name).generate(input_ids(1, 5), max_new_tokens=5, do_sample=False)
    assert torch.equal(model.generate(input_ids(1, 5), max_new_tokens=5, do_sample=False), gen_ref)


def test_experts_interface_trains():
    ref_model = make_model("qwen2_moe").train()
    model = copy.deepcopy(ref_model)
    model.set_experts_implementation("moe_ops")
    ids = input_ids()
    model(ids, labels=ids).loss.backward()
    ref_model(ids, labels=ids).loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        if q.grad is not None:
            assert rel_err(p.grad, q.grad) < 1e-5, n


@pytest.mark.parametrize("name", NAMES)
def test_empty_batch(name):
    """No tokens (T = 0): transformers' own blocks return an empty output; the patched router +
    experts and the "moe_ops" experts implementation did reshape(0, -1) and raised."""
    model = make_model(name)
    hidden = model.config.hidden_size
    blocks = [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate")]
    x = torch.randn(2, 0, hidden)
    with torch.no_grad():
        ref = [b(x) for b in blocks]
        apply_moe_ops(model)
        out = [b(x) for b in blocks]
        revert_moe_ops(model)
        model.set_experts_implementation("moe_ops")
        via_interface = [b(x) for b in blocks]
    for r, o, v in zip(ref, out, via_interface):
        r, o, v = (t[0] if isinstance(t, tuple) else t for t in (r, o, v))
        assert o.shape == v.shape == r.shape == (2, 0, hidden)


def test_from_pretrained_experts_implementation(tmp_path):
    model = make_model("mixtral")
    model.save_pretrained(tmp_path)
    ids = input_ids()
    loaded = type(model).from_pretrained(tmp_path, experts_implementation="moe_ops").eval()
    assert loaded.config._experts_implementation == "moe_ops"
    with torch.no_grad(), OpCounter() as c:
        out = loaded(ids).logits
        ref = model(ids).logits
    assert c.counts.get("dispatch", 0) == 2
    assert rel_err(out, ref) < 1e-5


# ------------------------------------------------------------------------------------------------
# Unsupported models and layouts


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(intermediate_size=96, **COMMON)).eval()


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    cfg = GptOssConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                       sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                       **COMMON)
    return GptOssForCausalLM(cfg).eval()


def test_unsupported_dense_model_raises():
    model = _llama()
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        apply_moe_ops(model)
    assert_pristine(model)


def test_unsupported_experts_layout_in_known_block_raises():
    """A known block whose experts do not fit the op is refused, and nothing is patched."""
    model = make_model("mixtral")
    model.model.layers[1].mlp.experts.act_fn = torch.nn.Tanh()
    with pytest.raises(UnsupportedModelError, match="activation Tanh"):
        apply_moe_ops(model)
    assert_pristine(model)


# ------------------------------------------------------------------------------------------------
# Gating activations (configs with hidden_act other than "silu")


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast", "relu",
                                 "swish", "gelu_python"])
def test_gated_activations(act):
    """GELU (erf and tanh forms), ReLU and SiLU-gated configs run on moe.dispatch with the
    matching activation, through both routes, and give transformers' logits."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(intermediate_size=96, num_local_experts=4,
                                             num_experts_per_tok=2, hidden_act=act,
                                             **COMMON)).eval()
    ids = input_ids()
    with torch.no_grad():
        model.set_experts_implementation("eager")
        ref = model(ids).logits
        model.set_experts_implementation("moe_ops")
        with OpCounter() as c:
            via_interface = model(ids).logits
        assert c.counts == {"dispatch": 2}
        model.set_experts_implementation("eager")
        apply_moe_ops(model)
        with OpCounter() as c:
            patched = model(ids).logits
        assert c.counts == {"route": 2, "dispatch": 2}
    assert rel_err(via_interface, ref) < 1e-5
    assert rel_err(patched, ref) < 1e-5


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "gelu_new", "relu"])
def test_activation_names(act):
    from transformers.activations import ACT2FN

    from moe_ops.integrations._hf_layouts import activation_name

    expected = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                "relu": "relu"}[act]
    assert activation_name(ACT2FN[act]) == expected


@pytest.mark.parametrize("act", ["tanh", "quick_gelu", "relu2", "gelu_10", "mish"])
def test_other_activations_refused(act):
    """Any other gating activation is refused by both routes, the message naming it."""
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.activations import ACT2FN

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(intermediate_size=96, num_local_experts=4,
                                             num_experts_per_tok=2, hidden_act=act,
                                             **COMMON)).eval()
    name = type(ACT2FN[act]).__name__
    with pytest.raises(UnsupportedModelError, match=f"activation {name}"):
        apply_moe_ops(model)
    assert_pristine(model)
    model.set_experts_implementation("moe_ops")
    with pytest.raises(UnsupportedModelError, match=f"activation {name}"), torch.no_grad():
        model(input_ids())


@pytest.mark.parametrize("fn", [apply_moe_ops, revert_moe_ops, is_patched])
def test_not_a_module_raises(fn):
    with pytest.raises(TypeError, match=f"{fn.__name__} expects a torch.nn.Module or None"):
        fn("mixtral")
    with pytest.raises(TypeError, match="got int"):
        fn(123)


# ------------------------------------------------------------------------------------------------
# torch.compile


def test_compile_patched_model():
    model = apply_moe_ops(make_model("mixtral"))
    ids = input_ids()
    with torch.no_grad():
        ref = model(ids).logits
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        out = compiled(ids).logits
    assert rel_err(out, ref) < 1e-5


# ------------------------------------------------------------------------------------------------
# GPU: bf16 on CUDA, Triton kernels

BF16_TOL = 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_gpu_bf16_logits(name):
    model = make_model(name, dtype=torch.bfloat16, device="cuda")
    ids = input_ids(device="cuda")
    with torch.no_grad():
        ref = model(ids).logits.float()
        apply_moe_ops(model)
        out = model(ids).logits.float()
        revert_moe_ops(model)
        model.set_experts_implementation("moe_ops")
        via_interface = model(ids).logits.float()
    assert rel_err(out, ref) < BF16_TOL
    assert rel_err(via_interface, ref) < BF16_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_gpu_bf16_training_step(name):
    ref_model = make_model(name, dtype=torch.bfloat16, device="cuda").train()
    model = apply_moe_ops(copy.deepcopy(ref_model))
    ids = input_ids(device="cuda")
    out = model(ids, labels=ids)
    ref = ref_model(ids, labels=ids)
    out.loss.backward()
    ref.loss.backward()
    assert rel_err(out.loss.float(), ref.loss.float()) < BF16_TOL
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        if q.grad is None:
            continue
        assert p.grad is not None, n
        assert rel_err(p.grad.float(), q.grad.float()) < 5e-2, n


@pytest.mark.gpu
def test_gpu_bf16_generate():
    """Greedy tokens of a bf16 model: ties may flip a late token, so the first tokens must agree."""
    model = make_model("mixtral", dtype=torch.bfloat16, device="cuda")
    ids = input_ids(batch=1, seq=5, device="cuda")
    kw = dict(max_new_tokens=4, do_sample=False, min_new_tokens=4)
    ref = model.generate(ids, **kw)
    apply_moe_ops(model)
    out = model.generate(ids, **kw)
    assert torch.equal(out[:, : ids.shape[1] + 1], ref[:, : ids.shape[1] + 1])


@pytest.mark.gpu
def test_gpu_float64_model_refused_at_patch_time():
    """moe.dispatch runs float64 on the CPU only: a float64 model on CUDA is refused by
    apply_moe_ops (nothing patched) and by the "moe_ops" experts function, naming float64."""
    model = make_model("qwen3_moe", dtype=torch.float64, device="cuda")
    with pytest.raises(UnsupportedModelError, match="float64 on cuda"):
        apply_moe_ops(model)
    assert not is_patched(model)
    model.set_experts_implementation("moe_ops")
    with pytest.raises(UnsupportedModelError, match="float64 on cuda"), torch.no_grad():
        model(input_ids(device="cuda"))


@pytest.mark.gpu
@pytest.mark.inductor
def test_gpu_compile_patched_model():
    model = apply_moe_ops(make_model("qwen3_moe", dtype=torch.bfloat16, device="cuda"))
    ids = input_ids(device="cuda")
    with torch.no_grad():
        ref = model(ids).logits.float()
        torch._dynamo.reset()
        out = torch.compile(model, fullgraph=True)(ids).logits.float()
    assert rel_err(out, ref) < BF16_TOL


def test_experts_interface_dense_routing_weights():
    """[T, E] dense routing weights (older DeepSeek-V2 style) are accepted by the "moe_ops"
    experts function: the selected experts' weights are gathered by id, so the result equals
    the call with the [T, K] weights (and transformers' own experts). Each token's ids are in
    descending order, so taking the first K columns instead of gathering gives other weights."""
    model = make_model("mixtral")
    experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    E, H = experts.gate_up_proj.shape[0], experts.gate_up_proj.shape[2]
    T, K = 7, 2
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g)
    dense = torch.rand(T, E, generator=g) + 0.1
    ids = torch.stack([torch.randperm(E, generator=g)[:K].sort(descending=True).values
                       for _ in range(T)])
    ids[0] = torch.tensor([E - 1, E - 2])    # (at least one row whose ids are not 0..K-1)
    sparse = dense.gather(1, ids)
    with torch.no_grad():
        ref = experts(x, ids, sparse)
        got_sparse = hf.moe_ops_experts_forward(experts, x, ids, sparse)
        got_dense = hf.moe_ops_experts_forward(experts, x, ids, dense)
    assert rel_err(got_sparse, ref) < 1e-5
    assert rel_err(got_dense, ref) < 1e-5


# ------------------------------------------------------------------------------------------------
# gpt-oss: transposed, interleaved, biased experts with the clamped SwiGLU; top-k-then-softmax
# router with a bias


def _randomise_biases(model):
    with torch.no_grad():
        for m in model.modules():
            for n in ("gate_up_proj_bias", "down_proj_bias"):
                if isinstance(getattr(m, n, None), torch.Tensor):
                    getattr(m, n).normal_(0.0, 0.3)
            if type(m).__name__ == "GptOssTopKRouter":
                m.weight.normal_(0.0, 0.3)
                m.bias.normal_(0.0, 0.3)
    return model


def test_gpt_oss_zero_copy_views():
    """The op reads gate_up_proj [E, H, 2I] / down_proj [E, I, H] as transposed views, never a
    copy, with the module's own alpha and limit."""
    model = _gpt_oss()
    experts = model.model.layers[0].mlp.experts
    layout = hf.experts_layout(experts)
    assert layout.w13.data_ptr() == experts.gate_up_proj.data_ptr()
    assert layout.w2.data_ptr() == experts.down_proj.data_ptr()
    assert layout.w13.shape == (4, 64, 64) and layout.w2.shape == (4, 64, 32)
    assert layout.w13_bias is experts.gate_up_proj_bias and layout.w2_bias is experts.down_proj_bias
    assert layout.activation == "swiglu_oai" and layout.gate_up_interleaved
    assert (layout.alpha, layout.limit) == (experts.alpha, experts.limit)


@pytest.mark.parametrize("route", ["interface", "apply"])
def test_gpt_oss_logits_and_gradients(route):
    ref_model = _randomise_biases(_gpt_oss()).train()
    ref_model.set_experts_implementation("eager")
    model = copy.deepcopy(ref_model)
    if route == "interface":
        model.set_experts_implementation("moe_ops")
    else:
        apply_moe_ops(model)
    ids = input_ids()
    with OpCounter() as c:
        out = model(ids, labels=ids)
    assert c.counts.get("dispatch", 0) + c.counts.get("dispatch_train", 0) == 2, c.counts
    assert c.counts.get("route", 0) == (2 if route == "apply" else 0)
    ref = ref_model(ids, labels=ids)
    assert rel_err(out.logits, ref.logits) < 1e-5
    out.loss.backward()
    ref.loss.backward()
    grads = dict(model.named_parameters())
    for n, p in ref_model.named_parameters():
        if p.grad is None:
            continue
        assert grads[n].grad is not None, n
        assert rel_err(grads[n].grad, p.grad) < 1e-4, n
    assert grads["model.layers.0.mlp.experts.gate_up_proj_bias"].grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------------
# DeepSeek-V3 with top_k above what its group limit allows


def test_deepseek_v3_top_k_above_group_limit():
    """top_k = 3 with topk_group = 1 group of 8 / 4 = 2 experts: transformers masks the other
    groups and takes the top 3 over all experts, so it picks a masked expert. The patched router
    gives transformers' result (its own arithmetic, same tie-breaking), through both routes."""
    model = make_model("deepseek_v3", n_group=4, topk_group=1, num_experts_per_tok=3)
    ids = input_ids()
    block = model.model.layers[1].mlp
    hidden = torch.randn(33, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref_logits, ref_w, ref_ids = block.gate(hidden)
        ref = model(ids).logits
        model.set_experts_implementation("moe_ops")
        assert rel_err(model(ids).logits, ref) < 1e-5
        model.set_experts_implementation("eager")
        apply_moe_ops(model)
        logits, w, got_ids = block.gate(hidden)
        out = model(ids).logits
    assert torch.equal(logits, ref_logits) and torch.equal(got_ids, ref_ids)
    assert torch.equal(w, ref_w)
    assert rel_err(out, ref) < 1e-5
    try:
        apply_moe_ops()
        fresh = make_model("deepseek_v3", n_group=4, topk_group=1, num_experts_per_tok=3)
        with torch.no_grad():
            assert rel_err(fresh(ids).logits, ref) < 1e-5
    finally:
        revert_moe_ops()


def test_deepseek_v3_zero_masking_detected():
    """A router whose source masks the discarded groups with 0.0 (older transformers) is left to
    its own forward: moe.route never picks a discarded group's expert, 0.0 masking does whenever
    an allowed expert's biased score is negative."""
    from moe_ops.integrations import _hf_routers

    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    class ZeroMasking(DeepseekV3TopkRouter):
        def forward(self, hidden_states):  # the masking line of transformers < 5.x
            scores_for_choice = hidden_states
            score_mask = hidden_states > 0
            return scores_for_choice.masked_fill(~score_mask.bool(), 0.0)

    assert _hf_routers._masks_with_zero(ZeroMasking)
    assert not _hf_routers._masks_with_zero(DeepseekV3TopkRouter) or "0.0)" in __import__(
        "inspect").getsource(DeepseekV3TopkRouter)


# ------------------------------------------------------------------------------------------------
# The class route keeps set_experts_implementation working


def test_class_route_honours_set_experts_implementation():
    """After apply_moe_ops() (classes), a model's experts run moe_ops by default, and
    set_experts_implementation("eager" / "grouped_mm" / "moe_ops") takes effect."""
    ref_model = make_model("mixtral")
    ids = input_ids()
    with torch.no_grad():
        ref = ref_model(ids).logits
    try:
        apply_moe_ops()
        model = make_model("mixtral")
        with torch.no_grad():
            for impl, dispatches in ((None, 2), ("eager", 0), ("grouped_mm", 0), ("moe_ops", 2),
                                     ("batched_mm", 0)):
                if impl is not None:
                    model.set_experts_implementation(impl)
                with OpCounter() as c:
                    out = model(ids).logits
                assert c.counts.get("dispatch", 0) == dispatches, (impl, c.counts)
                assert c.counts.get("route", 0) == 2  # the routers stay patched
                assert rel_err(out, ref) < 1e-5, impl
    finally:
        revert_moe_ops()


def test_class_route_export_with_batched_mm_experts():
    """transformers' export tests set the experts to "batched_mm" on models built after the class
    route: the export keeps moe.route (the patched router) and no moe.dispatch, and matches."""
    ids = input_ids()
    try:
        apply_moe_ops()
        model = make_model("mixtral").eval()
        model.set_experts_implementation("batched_mm")
        with torch.no_grad():
            ref = model(ids, use_cache=False).logits
        ep = torch.export.export(model, (ids,), {"use_cache": False}, strict=False)
        targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
        assert any("moe.route" in t for t in targets), sorted(targets)[:20]
        assert not any("moe.dispatch" in t for t in targets)
        torch.testing.assert_close(ep.module()(ids, use_cache=False).logits, ref, rtol=1e-5,
                                   atol=1e-5)
    finally:
        revert_moe_ops()


def test_class_route_honours_from_pretrained_choice(tmp_path):
    make_model("qwen3_moe").save_pretrained(tmp_path)
    ids = input_ids()
    try:
        apply_moe_ops()
        cls = FAMILIES["qwen3_moe"]()[0]
        chosen = cls.from_pretrained(tmp_path, experts_implementation="eager").eval()
        default = cls.from_pretrained(tmp_path).eval()
        with torch.no_grad(), OpCounter() as c:
            chosen(ids)
        assert c.counts.get("dispatch", 0) == 0
        with torch.no_grad(), OpCounter() as c:
            default(ids)
        assert c.counts.get("dispatch", 0) == 2
    finally:
        revert_moe_ops()


def test_class_route_falls_back_for_uncovered_layouts():
    """A layout moe.dispatch does not compute keeps transformers' experts under the class route
    (a warning names the difference); a model asking for "moe_ops" explicitly is refused."""
    from transformers import MixtralConfig, MixtralForCausalLM

    def build():
        torch.manual_seed(0)
        return MixtralForCausalLM(MixtralConfig(intermediate_size=96, num_local_experts=4,
                                                num_experts_per_tok=2, hidden_act="tanh",
                                                **COMMON)).eval()
    ids = input_ids()
    with torch.no_grad():
        ref = build()(ids).logits
    try:
        apply_moe_ops()
        model = build()
        with torch.no_grad(), pytest.warns(UserWarning, match="activation Tanh"):
            out = model(ids).logits
        assert rel_err(out, ref) < 1e-5
        model.set_experts_implementation("moe_ops")
        with pytest.raises(UnsupportedModelError, match="activation Tanh"), torch.no_grad():
            model(ids)
    finally:
        revert_moe_ops()
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers import PreTrainedModel, PretrainedConfig
    assert "get_interface" not in vars(ALL_EXPERTS_FUNCTIONS)
    assert not hf.is_patched()
    assert isinstance(vars(PretrainedConfig)["_experts_implementation"], property)
    assert "moe_ops" not in PreTrainedModel.set_experts_implementation.__code__.co_filename


def test_class_route_ignores_transformers_own_switches():
    """generate() on a GPU switches "grouped_mm" to "batched_mm" for the decode and back, through
    set_experts_implementation: that is not the user's choice, and the experts stay on moe_ops."""
    from transformers.generation import utils as gen_utils

    try:
        apply_moe_ops()
        model = make_model("mixtral")
        # what _optimize_model_for_decode does, called from a transformers module
        switch = eval(compile("lambda m, impl: m.set_experts_implementation(impl)",
                              gen_utils.__file__, "eval"), {"__name__": gen_utils.__name__})
        switch(model, "batched_mm")
        with torch.no_grad(), OpCounter() as c:
            model(input_ids())
        assert c.counts.get("dispatch", 0) == 2
        switch(model, "grouped_mm")
        with torch.no_grad(), OpCounter() as c:
            model(input_ids())
        assert c.counts.get("dispatch", 0) == 2
        model.set_experts_implementation("batched_mm")  # the user's choice
        with torch.no_grad(), OpCounter() as c:
            model(input_ids())
        assert c.counts.get("dispatch", 0) == 0
    finally:
        revert_moe_ops()


def test_custom_gate_identified_per_setting():
    """A custom gate is identified by evaluating it, per setting: Step3p7-style gating (SiLU, then
    a clamp when `limit` is set) is SiLU without a limit and silu_clamp_out with one; with a
    softcap instead of the clamp it is refused."""
    from moe_ops.integrations._hf_layouts import experts_layout

    model = make_model("mixtral")
    experts = model.model.layers[0].mlp.experts

    class ClampedExperts(type(experts)):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            gate = self.act_fn(gate)
            if self.limit is not None:
                gate = gate.clamp(max=self.limit)
                up = up.clamp(min=-self.limit, max=self.limit)
            return gate * up

    experts.__class__ = ClampedExperts
    experts.limit = None
    assert experts_layout(experts).activation == "silu"
    experts.limit = 7.0
    layout = experts_layout(experts)
    assert (layout.activation, layout.limit) == ("silu_clamp_out", 7.0)

    class SoftcappedExperts(type(experts)):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return self.act_fn(gate) * torch.tanh(up / self.limit) * self.limit

    experts.__class__ = SoftcappedExperts
    with pytest.raises(UnsupportedModelError, match="custom gating SoftcappedExperts._apply_gate"):
        experts_layout(experts)


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["interface", "apply"])
def test_gpu_bf16_gpt_oss(route):
    """gpt-oss in bf16 on CUDA (Triton kernels with the transposed, interleaved, biased,
    swiglu_oai variant): logits and a training step against transformers' eager experts. Each
    parameter's gradient error against a float32 eager model is bounded by twice eager bf16's own
    error plus 1e-2 (a few-element gradient such as an attention sink's cancels to rounding
    noise in bf16: two bf16 runs differed by 5.3% there on the H200)."""
    ref_model = _randomise_biases(_gpt_oss()).to(device="cuda", dtype=torch.bfloat16).train()
    ref_model.set_experts_implementation("eager")
    model = copy.deepcopy(ref_model)
    f32_model = copy.deepcopy(ref_model).float()
    if route == "interface":
        model.set_experts_implementation("moe_ops")
    else:
        apply_moe_ops(model)
    ids = input_ids(device="cuda")
    out = model(ids, labels=ids)
    ref = ref_model(ids, labels=ids)
    assert rel_err(out.logits.float(), ref.logits.float()) < BF16_TOL
    out.loss.backward()
    ref.loss.backward()
    f32_model(ids, labels=ids).loss.backward()
    for (n, p), (_, q), (_, r) in zip(model.named_parameters(), ref_model.named_parameters(),
                                      f32_model.named_parameters()):
        if q.grad is None:
            continue
        assert p.grad is not None, n
        eager_err = rel_err(q.grad.float(), r.grad.float())
        assert rel_err(p.grad.float(), r.grad.float()) <= 2 * eager_err + 1e-2, n


def test_compile_does_not_trace_the_gate_settings(monkeypatch):
    """torch 2.11's Dynamo cannot trace vars() of a module (the GPU run found the compiled
    patched model failing there): a compiled forward takes the gate arithmetic cached at
    apply time and never reads the module's settings inside the trace."""
    import moe_ops.integrations._hf_layouts as lay

    real = lay._gate_settings

    def settings(experts):
        if torch.compiler.is_compiling():
            raise AssertionError("gate settings read inside the compiled trace")
        return real(experts)

    monkeypatch.setattr(lay, "_gate_settings", settings)
    model = apply_moe_ops(make_model("qwen3_moe"))
    ids = input_ids()
    with torch.no_grad():
        ref = model(ids).logits
        torch._dynamo.reset()
        out = torch.compile(model, backend="aot_eager", fullgraph=True)(ids).logits
    assert rel_err(out, ref) < 1e-5


def test_compile_fullgraph_class_route_and_gpt_oss():
    """One graph (fullgraph) for the class route's experts lookup and for gpt-oss's variant
    arguments: nothing in the patched paths reads source code or breaks the graph."""
    ids = input_ids()
    try:
        apply_moe_ops()
        model = make_model("mixtral")
        model.set_experts_implementation("moe_ops")
        with torch.no_grad():
            ref = model(ids).logits
            torch._dynamo.reset()
            out = torch.compile(model, backend="aot_eager", fullgraph=True)(ids).logits
        assert rel_err(out, ref) < 1e-5
    finally:
        revert_moe_ops()
    model = apply_moe_ops(_randomise_biases(_gpt_oss()))
    with torch.no_grad():
        ref = model(ids).logits
        torch._dynamo.reset()
        out = torch.compile(model, backend="aot_eager", fullgraph=True)(ids).logits
    assert rel_err(out, ref) < 1e-5


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="CPU-only check: with triton 3.6 on a CUDA machine, an interpreted launch "
                           "fails and breaks the CUDA launches after it in the process")
@needs_interpreter
def test_gpt_oss_triton_interpreter(monkeypatch):
    """gpt-oss's variant (transposed views, interleaved, biases, swiglu_oai) through the Triton
    kernels, run by Triton's interpreter on CPU."""
    model = _randomise_biases(_gpt_oss())
    model.set_experts_implementation("eager")
    _assert_interpreted_logits_match(model, monkeypatch)
