"""Every MoE family of the installed transformers, and a tiny random model of each.

`families()` reads the installed package (not a list kept here): every modeling module with an
`@use_experts_implementation` experts class or a sparse-MoE block class. A family added by a later
transformers release is therefore enumerated, and its test fails (no tiny config known, or a
result that is neither equal to eager nor a named refusal) instead of being skipped in silence.

`build(family)` makes a tiny model from the family's config class (nothing is downloaded): the
generic small sizes below, applied to the config fields the class has, plus the few per-family
values its validators or layer patterns need."""
from __future__ import annotations

import importlib
import os
import re

import torch

import transformers

ROOT = os.path.join(os.path.dirname(transformers.__file__), "models")

_BLOCK = re.compile(r"^class \w*(SparseMoe|SparseMLP|MoE|Moe)\w*\(nn\.Module\)", re.M)


def families() -> list[str]:
    out = []
    for fam in sorted(os.listdir(ROOT)):
        path = os.path.join(ROOT, fam, f"modeling_{fam}.py")
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            src = f.read()
        # DBRX's block (DbrxFFN) and Llama 4's (Llama4TextMoe) do not follow either pattern.
        if "@use_experts_implementation" in src or _BLOCK.search(src) or fam in ("dbrx", "llama4"):
            out.append(fam)
    return out


def uses_experts_interface(fam: str) -> bool:
    with open(os.path.join(ROOT, fam, f"modeling_{fam}.py"), encoding="utf-8") as f:
        return "@use_experts_implementation" in f.read()


# Generic tiny sizes, applied to the fields a config class has: hidden 32, 2 layers, 8 experts,
# top-2, 4 heads of 8, MoE in every layer (no dense first layers).
SMALL = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, head_dim=8, max_position_embeddings=64, num_experts=8,
    num_local_experts=8, n_routed_experts=8, moe_num_experts=8, num_experts_per_tok=2,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    first_k_dense_replace=0, decoder_sparse_step=1, mlp_only_layers=[], n_group=2, topk_group=1,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
    # Jamba: attention in layer 1, experts in every layer
    attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0,
)

# What a family's validators or layer patterns need beyond SMALL.
PER_FAMILY = {
    "bailing_hybrid": dict(num_expert_group=2, topk_group=1, num_experts_per_token=2,
                           num_shared_experts=1, expert_swiglu_limit_list=[0, 0],
                           share_expert_swiglu_limit_list=[0, 0]),
    "dbrx": dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
                 attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}),
    "deepseek_ocr2": dict(mlp_layer_types=["sparse", "sparse"]),
    "diffusion_gemma": dict(top_k_experts=2),
    "doge": dict(is_moe=True, num_experts=16, num_experts_per_tok=2),
    "dots1": dict(n_shared_experts=1),
    "ernie4_5_vl_moe": dict(moe_intermediate_size=[32, 32], moe_k=2, moe_num_shared_experts=1,
                            rope_parameters={"rope_theta": 10000.0, "rope_type": "default",
                                             "mrope_section": [1, 1, 2]}),
    "gemma4": dict(enable_moe_block=True, top_k_experts=2),
    "glm4v_moe": dict(rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                       "rope_type": "default", "mrope_section": [1, 1, 0]}),
    "glm5_next": dict(qk_rope_head_dim=0, head_dim=0, qk_nope_head_dim=8, v_head_dim=8,
                      index_head_dim=8, index_n_heads=2, linear_head_dim=8, linear_num_heads=4),
    "granitemoehybrid": dict(mamba_n_heads=8, mamba_d_head=8,
                             layer_types=["linear_attention", "full_attention"]),
    "hy_v4_vl": dict(rope_parameters={"rope_theta": 10000.0, "rope_type": "default",
                                      "mrope_section": [2, 1, 1]}),
    "kolibri1_1": dict(head_dim=16, index_num_heads=1),
    "lfm2_moe": dict(num_dense_layers=0, layer_types=["conv", "full_attention"]),
    "longcat_flash": dict(moe_topk=2, zero_expert_num=2, expert_ffn_hidden_size=32),
    "mimo_v2_flash": dict(num_key_value_heads=2),  # sliding layers double the KV heads
    "mistral4": dict(head_dim=16),
    "nllb_moe": dict(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2,
                     encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_attention_heads=4,
                     decoder_attention_heads=4, num_experts=4, max_position_embeddings=64),
    "switch_transformers": dict(vocab_size=128, d_model=32, d_ff=64, d_kv=8, num_heads=4,
                                num_layers=2, num_decoder_layers=2, num_experts=4),
    "qwen4_exp": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8,
                      indexer_compress_ratio=2, linear_key_head_dim=8, linear_value_head_dim=8,
                      linear_num_key_heads=2, linear_num_value_heads=4),
    "step3p7": dict(sliding_window=16),
    "vitpose_backbone": dict(part_features=8, num_experts=2, hidden_size=32,
                             num_attention_heads=4, num_hidden_layers=1, image_size=[32, 32],
                             patch_size=[16, 16]),
    "zaya": dict(num_experts_per_tok=1),
}


def model_class(fam: str):
    """The family's causal LM (or its text model, for multimodal families)."""
    mod = importlib.import_module(f"transformers.models.{fam}.modeling_{fam}")
    cands = [c for c in vars(mod).values()
             if isinstance(c, type) and issubclass(c, transformers.PreTrainedModel)
             and c.__module__ == mod.__name__ and "PreTrained" not in c.__name__
             and not any(s in c.__name__ for s in ("Vision", "Audio", "Talker", "CodePredictor"))]
    for pred in (lambda n: n.endswith("ForCausalLM"), lambda n: n.endswith("TextModel"),
                 lambda n: n.endswith("Backbone"),
                 lambda n: n.endswith("Model"), lambda n: True):
        for c in cands:
            if pred(c.__name__):
                return c
    raise LookupError(f"transformers.models.{fam}: no model class found")


def _pick_layer_types(types_):
    """Two layers of the default pattern, one of them full attention where the pattern has
    one (hybrid models: a linear-attention layer alone has no attention mask to build)."""
    full = [t for t in types_ if "attention" in t and "linear" not in t]
    other = [t for t in types_ if t not in full]
    return [other[0], full[0]] if full and other else list(types_[:2])


def config_for(fam: str, **over):
    cls = model_class(fam)
    cfg_cls = cls.config_class
    defaults = cfg_cls()
    fields = set(defaults.to_dict())
    kw = {k: v for k, v in SMALL.items() if k in fields}
    lt = defaults.to_dict().get("layer_types")
    if isinstance(lt, list) and len(lt) >= 2 and all(isinstance(t, str) for t in lt):
        kw["layer_types"] = _pick_layer_types(lt)
    mlt = defaults.to_dict().get("mlp_layer_types")
    if isinstance(mlt, list) and mlt:
        moe = [t for t in mlt if any(s in t for s in ("moe", "sparse", "expert"))]
        kw["mlp_layer_types"] = [moe[0]] * 2 if moe else list(mlt[:2])
    kw.update(PER_FAMILY.get(fam, {}))
    kw.update(over)
    return cls, cfg_cls(**kw)


def build(fam: str, seed: int = 0, **over):
    cls, config = config_for(fam, **over)
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():
        for module in model.modules():
            # Random biases (transformers initialises them to zero): a bias the op drops, or a
            # selection bias it ignores, must show up in the logits.
            router = any(s in type(module).__name__ for s in ("Router", "Gate"))
            for name, t in [*module.named_parameters(recurse=False),
                            *module.named_buffers(recurse=False)]:
                if not t.is_floating_point():
                    continue
                if name in ("e_score_correction_bias", "gate_up_proj_bias", "down_proj_bias") or (
                        router and name == "bias"):
                    t.normal_(0.0, 0.3)
    return model.float().eval()
