"""A DeepSeek-V3-architecture transformers model with FP8 block-scaled experts on moe_ops.

The model is built from a config with random weights (nothing is downloaded): on CPU a tiny one
(float32, H=256, 8 experts of I=128), on a GPU one MoE layer at DeepSeek-V3's full width
(H=7168, 256 experts of I=2048, top-8; bfloat16). Every MoE layer's experts are quantized to
FP8 e4m3 with one float32 scale per [128, 128] block (DeepSeek's `weight_scale_inv` layout),
then the model decodes greedily three ways:

1. transformers' own experts on the dequantized weights (the float model: what the FP8 model
   approximates),
2. transformers' `FP8Experts` modules holding the FP8 weights and scales, run through
   `moe.dispatch` (moe_ops.integrations.hf_quant.fp8_experts_forward) with activations
   quantized per token and per 128 columns (W8A8, as DeepSeek-V3 inference does),
3. the same with bf16 activations (W8A16).

It prints tokens/s, how far the prompt's logits move from (1), and how many generated tokens
agree with (1). W8A8 changes each MoE output by a few percent (issue 42 measures 4%), and a
random model's logits are nearly flat (near ties everywhere), so its greedy tokens part from the
float model's early; W8A16 stays much closer.

    python examples/hf_fp8_moe.py [--new-tokens 32] [--batch 2]
"""
from __future__ import annotations

import argparse
import sys
import time
import types

import torch

import moe_ops  # noqa: F401  (registers torch.ops.moe.*)
from moe_ops.integrations.hf_quant import fp8_experts_forward
from moe_ops.reference.quant import dequantize_fp8_block, quantize_fp8_block

try:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.integrations.finegrained_fp8 import FP8Experts
except ImportError:  # pragma: no cover
    sys.exit("this example needs transformers 5.x with FineGrainedFP8 (FP8Experts)")


def config(device: torch.device) -> DeepseekV3Config:
    if device.type == "cuda":
        width = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                     n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
                     num_attention_heads=16, num_key_value_heads=16, q_lora_rank=1536,
                     kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                     v_head_dim=128)
    else:
        width = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                     n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                     num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
                     kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
    return DeepseekV3Config(vocab_size=512, num_hidden_layers=2, first_k_dense_replace=1,
                            n_shared_experts=1, max_position_embeddings=512, **width)


def quantize_experts(model, block=(128, 128)):
    """Replaces every MoE layer's experts weights by their FP8 round trip (the float model then
    computes with exactly the weights the FP8 model holds) and returns (experts module, its
    FP8Experts twin) pairs."""
    pairs = []
    for name, mod in model.named_modules():
        if not name.endswith("mlp.experts"):
            continue
        w13, w2 = mod.gate_up_proj.data, mod.down_proj.data
        with torch.device(w13.device):   # (11 GB of FP8 at full width: allocated in place)
            fp8 = FP8Experts(model.config, block_size=block)
        with torch.no_grad():
            for e in range(w13.shape[0]):   # one expert at a time: no float32 copy of them all
                q, s = quantize_fp8_block(w13[e], block)
                fp8.gate_up_proj.data[e], fp8.gate_up_proj_scale_inv.data[e] = q, s
                w13[e] = dequantize_fp8_block(q, s, block).to(w13.dtype)
                q, s = quantize_fp8_block(w2[e], block)
                fp8.down_proj.data[e], fp8.down_proj_scale_inv.data[e] = q, s
                w2[e] = dequantize_fp8_block(q, s, block).to(w2.dtype)
        fp8.forward = types.MethodType(fp8_experts_forward, fp8)
        pairs.append((name, mod, fp8))
    return pairs


def swap(model, pairs, which):
    for name, float_mod, fp8_mod in pairs:
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        parent.experts = float_mod if which == "float" else fp8_mod


def decode(model, prompt, new_tokens):
    """(generated ids, tokens/s) of greedy decoding."""
    if prompt.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False,
                             min_new_tokens=new_tokens, pad_token_id=0)
    if prompt.device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return out[:, prompt.shape[1]:], prompt.shape[0] * new_tokens / dt


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--batch", type=int, default=2)
    opts = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(dev):
        model = DeepseekV3ForCausalLM(config(dev)).to(dtype).eval()
    pairs = quantize_experts(model)
    prompt = torch.randint(1, model.config.vocab_size, (opts.batch, 8), device=dev)
    swap(model, pairs, "float")
    ref, tps_ref = decode(model, prompt, opts.new_tokens)
    with torch.inference_mode():
        logits_ref = model(prompt).logits.double()
    print(f"{dev.type}: {len(pairs)} MoE layer(s), {model.config.n_routed_experts} experts, "
          f"H={model.config.hidden_size}, I={model.config.moe_intermediate_size}, {dtype}")
    print(f"  float experts (dequantized weights): {tps_ref:8.1f} tokens/s")
    swap(model, pairs, "fp8")
    for label, quant_a in (("FP8 W8A8 on moe_ops", True), ("FP8 W8A16 on moe_ops", False)):
        for _, _, fp8 in pairs:
            fp8.moe_ops_quantize_activations = quant_a
        got, tps = decode(model, prompt, opts.new_tokens)
        with torch.inference_mode():
            d = model(prompt).logits.double() - logits_ref
        # the logits' change relative to their spread over the vocabulary: a random model's
        # logits are nearly flat, so greedy tokens are near ties and part at tiny changes
        rel = (d.norm() / (logits_ref - logits_ref.mean(-1, keepdim=True)).norm()).item()
        same = (got == ref).float().mean().item()
        parted = (got != ref).any(0).nonzero()
        where = f", first differs at token {int(parted[0])}" if parted.numel() else ""
        print(f"  {label:<22}: {tps:8.1f} tokens/s, prompt logits moved {rel:.1e} (of their "
              f"spread), {100 * same:.0f}% of tokens as the float model{where}")


if __name__ == "__main__":
    main()
