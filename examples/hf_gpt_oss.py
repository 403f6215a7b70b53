"""moe_ops on a HuggingFace transformers gpt-oss model: `apply_moe_ops(model)`.

gpt-oss's experts differ from Mixtral's in every way the op has an argument for: `gate_up_proj` is
stored `[E, H, 2I]` (the op reads it as `gate_up_proj.transpose(1, 2)`, a view), gate and up are
interleaved (even / odd columns), both projections have biases, and the activation is the clamped
SwiGLU `(clamp(u, -limit, limit) + 1) * g * sigmoid(alpha * g)` with `g = min(g, limit)`. Its router
takes the top-k logits (with a router bias) and a softmax over them.

Builds a gpt-oss model from a config with random weights (nothing is downloaded): a tiny one in
float32 on CPU, or one with gpt-oss-20b's layer sizes (hidden 2880, intermediate 2880, 32 experts,
top-4, 64 heads of 64) in bfloat16 on CUDA. Then:
  1. greedy tokens of transformers' "eager" experts against moe_ops, through both routes
     (`set_experts_implementation("moe_ops")` and `apply_moe_ops(model)`);
  2. one training step: loss and every parameter gradient (expert biases included) against eager,
     then the logits after an SGD step.

    python examples/hf_gpt_oss.py                  # CUDA if available, else CPU
    python examples/hf_gpt_oss.py --device cpu     # a few seconds
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import moe_ops  # noqa: E402,F401  (registers torch.ops.moe.* and the "moe_ops" experts implementation)
from moe_ops.tools.debug import OpCounter  # noqa: E402
from moe_ops.integrations.huggingface import apply_moe_ops, experts_layout  # noqa: E402


def build_model(device: str, layers: int, seed: int):
    from transformers import GptOssConfig, GptOssForCausalLM

    common = dict(num_hidden_layers=layers, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                  + ["sliding_attention"] * (layers % 2))
    if device == "cuda":
        # gpt-oss-20b's layer sizes (its vocabulary is 201088; 32000 keeps the embedding small).
        config = GptOssConfig(vocab_size=32000, hidden_size=2880, intermediate_size=2880,
                              num_local_experts=32, num_experts_per_tok=4, num_attention_heads=64,
                              num_key_value_heads=8, head_dim=64, sliding_window=128, **common)
        dtype = torch.bfloat16
    else:
        config = GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=48,
                              num_local_experts=8, num_experts_per_tok=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, sliding_window=16, **common)
        dtype = torch.float32
    torch.manual_seed(seed)
    with torch.device(device):
        model = GptOssForCausalLM._from_config(config, dtype=dtype)
    with torch.no_grad():
        # transformers initialises the biases (and gpt-oss's router) to zero: random ones make
        # every term of the expert arithmetic show in the result.
        for m in model.modules():
            for name in ("gate_up_proj_bias", "down_proj_bias"):
                if isinstance(getattr(m, name, None), torch.Tensor):
                    getattr(m, name).normal_(0.0, 0.1)
            if type(m).__name__ == "GptOssTopKRouter":
                m.weight.normal_(0.0, 0.05)
                m.bias.normal_(0.0, 0.1)
    model.set_experts_implementation("eager")
    return model.eval()


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    dev = args.device
    t0 = time.perf_counter()
    ref = build_model(dev, args.layers, args.seed)
    tol = 2e-2 if dev == "cuda" else 1e-5   # bfloat16 on CUDA, float32 on CPU
    experts = ref.model.layers[0].mlp.experts
    layout = experts_layout(experts)
    assert layout.w13.data_ptr() == experts.gate_up_proj.data_ptr()  # a view, not a copy
    print(f"{dev}: gpt-oss {args.layers} layers, hidden {ref.config.hidden_size}, "
          f"E={ref.config.num_local_experts}, top-{ref.config.num_experts_per_tok}; experts as "
          f"w13 {tuple(layout.w13.shape)} strides {layout.w13.stride()}, activation "
          f"{layout.activation} (alpha {layout.alpha}, limit {layout.limit}), interleaved "
          f"{layout.gate_up_interleaved}, biases {layout.w13_bias is not None}")

    g = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(3, ref.config.vocab_size, (2, 12), generator=g).to(dev)
    kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)

    # 1. tokens
    with torch.no_grad():
        ref_logits = ref(prompt).logits
        ref_tokens = ref.generate(prompt, **kw)
    interface = copy.deepcopy(ref)
    interface.set_experts_implementation("moe_ops")
    patched = apply_moe_ops(copy.deepcopy(ref))
    for name, model, calls in (("set_experts_implementation('moe_ops')", interface, {"dispatch"}),
                               ("apply_moe_ops(model)", patched, {"route", "dispatch"})):
        with torch.no_grad(), OpCounter() as c:
            logits = model(prompt).logits
        assert set(c.counts) == calls, c.counts
        with torch.no_grad():
            tokens = model.generate(prompt, **kw)
        err = rel_err(logits, ref_logits)
        # bfloat16: a near-tie may flip a late greedy token; the first new token must agree.
        n = tokens.shape[1] if dev == "cpu" else prompt.shape[1] + 1
        same = torch.equal(tokens[:, :n], ref_tokens[:, :n])
        print(f"  {name}: logits rel err {err:.2e}; {tokens.shape[1] - prompt.shape[1]} greedy "
              f"tokens {'equal to' if torch.equal(tokens, ref_tokens) else 'differ from'} eager")
        assert err < tol and same, (err, tokens, ref_tokens)

    # 2. one training step
    ref.train()
    model = apply_moe_ops(copy.deepcopy(ref)).train()
    ids = torch.randint(3, ref.config.vocab_size, (2, 16), generator=g).to(dev)
    ref_loss = ref(ids, labels=ids).loss
    loss = model(ids, labels=ids).loss
    ref_loss.backward()
    loss.backward()
    worst, worst_name = 0.0, None
    ref_params = dict(ref.named_parameters())
    for n, p_ in model.named_parameters():
        q = ref_params[n]
        if q.grad is None:
            assert p_.grad is None, n
            continue
        e = rel_err(p_.grad, q.grad)
        if e > worst:
            worst, worst_name = e, n
    bias_grad = model.model.layers[0].mlp.experts.gate_up_proj_bias.grad
    assert bias_grad is not None and bias_grad.abs().sum() > 0
    print(f"  training step: loss {loss.item():.5f} vs eager {ref_loss.item():.5f}; worst "
          f"gradient rel err {worst:.2e} ({worst_name})")
    assert rel_err(loss, ref_loss) < tol and worst < (5e-2 if dev == "cuda" else 1e-4)
    for m in (ref, model):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    with torch.no_grad():
        err = rel_err(model.eval()(ids).logits, ref.eval()(ids).logits)
    print(f"  after an SGD step: logits rel err {err:.2e}")
    assert err < tol
    print(f"ok ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
