"""Training a Mixtral-architecture language model with and without moe_ops: same initial weights,
same data, same optimizer; the loss curves must agree, and the step times are compared.

Builds a Mixtral-architecture causal LM from a config with random weights (nothing is downloaded):
a tiny float32 one on CPU (hidden 64, 2 layers, 4 experts top-2, vocab 128), a small bfloat16 one on
CUDA (hidden 1024, intermediate 2048, 4 layers, 8 experts top-2, vocab 1024). It is trained twice
on the same synthetic batches from the same initial weights (a deepcopy): once as plain
transformers (its default experts implementation, or `--baseline-experts`), once with
`apply_moe_ops` (routers on `torch.ops.moe.route`, experts on `torch.ops.moe.dispatch`, forward and
backward). The load-balancing auxiliary loss is on (`output_router_logits=True`) unless
`--no-aux-loss`.

    python examples/train_moe.py                       # CUDA if available, else CPU (tiny model)
    python examples/train_moe.py --device cpu --steps 60
    python examples/train_moe.py --device cuda --steps 200 --batch 8 --seq-len 1024
    python examples/train_moe.py --device cuda --baseline-experts eager
    python examples/train_moe.py --device cpu --dtype bfloat16   # the bfloat16 path, on CPU

Data: sequences from a fixed random first-order Markov chain over the vocabulary (every token has
`--branching` possible successors with random probabilities), so the loss falls from ln(vocab)
towards the chain's entropy rate, which is printed. All batches are drawn up front from a seeded
generator; both runs see them in the same order.

Optimizer: AdamW (betas 0.9/0.95, weight decay 0.01), linear warm-up then constant learning rate,
gradient norm clipped to 1.0. With bfloat16 parameters (CUDA) the optimizer steps float32 master
copies of the parameters (float32 AdamW state) and writes them back rounded to bfloat16.

Printed: both loss curves side by side every `--log-every` steps, the maximum relative difference
of the losses over the run, the relative difference of the final parameters, and the median step
time (forward + backward + optimizer step, synchronised on CUDA; the first steps, which compile
Triton kernels, are left out). Exits non-zero when the curves disagree:
- always: the mean loss of the last 10% of the steps within `--final-tolerance` (default 5e-2)
  relative;
- float32 parameters (CPU default): also every loss of the first `--exact-steps` steps (default 60)
  within `--tolerance` (default 1e-4) relative.
Rounding differences between two correct implementations compound over a training run: even
transformers' own "eager" and "grouped_mm" experts, both float32, agree to ~1e-7 for ~100 steps of
the CPU default and then drift apart to ~1e-2 by step 200 (a router top-k choice flips, and the
trajectories separate). Hence the per-step bound only over the first steps, and in bfloat16 only
the bound on the final mean.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import moe_ops  # noqa: E402  (registers torch.ops.moe.*)
from moe_ops.integrations.huggingface import apply_moe_ops  # noqa: E402

TIMING_WARMUP = 5  # steps left out of the median step time (Triton compilation, allocator warm-up)


def build_model(device: str, layers: int | None, aux_loss: bool, seed: int, dtype=None):
    from transformers import MixtralConfig, MixtralForCausalLM

    common = dict(num_experts_per_tok=2, output_router_logits=aux_loss, router_aux_loss_coef=0.01,
                  attention_dropout=0.0, router_jitter_noise=0.0, tie_word_embeddings=False,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if device == "cuda":
        config = MixtralConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2048,
                               num_hidden_layers=layers or 4, num_attention_heads=16,
                               num_key_value_heads=8, num_local_experts=8,
                               max_position_embeddings=4096, **common)
        dtype = dtype or torch.bfloat16
    else:
        config = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=layers or 2, num_attention_heads=4,
                               num_key_value_heads=2, num_local_experts=4,
                               max_position_embeddings=1024, **common)
        dtype = dtype or torch.float32
    torch.manual_seed(seed)
    with torch.device(device):
        model = MixtralForCausalLM._from_config(config, dtype=dtype)
    return model.train()


# ----------------------------------------------------------------------------------------------
# Synthetic data: a fixed random Markov chain


def markov_chain(vocab: int, branching: int, generator: torch.Generator) -> torch.Tensor:
    """[vocab, vocab] transition matrix: every token has `branching` random successors with
    random (softmax of 1.5 * normal) probabilities."""
    probs = torch.zeros(vocab, vocab, dtype=torch.float64)
    succ = torch.stack([torch.randperm(vocab, generator=generator)[:branching] for _ in range(vocab)])
    p = torch.softmax(1.5 * torch.randn(vocab, branching, generator=generator, dtype=torch.float64), -1)
    probs.scatter_(1, succ, p)
    return probs


def entropy_rate(probs: torch.Tensor) -> float:
    """Entropy rate (nats/token) of the chain under its stationary distribution (power iteration
    from uniform; the first position of a sequence is uniform, so this is the floor for long
    sequences)."""
    pi = torch.full((probs.shape[0],), 1.0 / probs.shape[0], dtype=torch.float64)
    for _ in range(2000):
        pi = pi @ probs
    row_h = -(probs * torch.log(probs.clamp_min(1e-300))).sum(1)
    return float(pi @ row_h)


def sample_batches(probs, steps, batch, seq_len, generator):
    """[steps, batch, seq_len] int64 token ids: uniform first token, then the chain."""
    vocab = probs.shape[0]
    out = torch.empty(steps * batch, seq_len, dtype=torch.long)
    out[:, 0] = torch.randint(0, vocab, (steps * batch,), generator=generator)
    for t in range(1, seq_len):
        out[:, t] = torch.multinomial(probs[out[:, t - 1]], 1, generator=generator).squeeze(1)
    return out.view(steps, batch, seq_len)


# ----------------------------------------------------------------------------------------------
# Training


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


class Optimizer:
    """AdamW with linear warm-up and gradient clipping; float32 master weights for low-precision
    parameters."""

    def __init__(self, model, lr, warmup):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = None
        if any(p.dtype != torch.float32 for p in self.params):
            self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.lr, self.warmup, self.step_count = lr, warmup, 0
        self.opt = torch.optim.AdamW(self.master or self.params, lr=lr, betas=(0.9, 0.95),
                                     eps=1e-8, weight_decay=0.01)

    def step(self):
        self.step_count += 1
        for group in self.opt.param_groups:
            group["lr"] = self.lr * min(1.0, self.step_count / max(1, self.warmup))
        if self.master is not None:
            for m, p in zip(self.master, self.params):
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        targets = self.master or self.params
        grad_norm = torch.nn.utils.clip_grad_norm_(targets, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.master is not None:
            with torch.no_grad():
                for m, p in zip(self.master, self.params):
                    p.copy_(m)
        return grad_norm


def train(model, batches, device, lr, warmup):
    """Trains on `batches` ([steps, B, L] on the CPU); returns (losses, step times in seconds,
    peak CUDA memory in bytes or None)."""
    opt = Optimizer(model, lr, warmup)
    losses, times = [], []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for ids in batches:
        ids = ids.to(device, non_blocking=True)
        sync(device)
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        opt.step()
        sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(out.loss.detach())
    losses = torch.stack(losses).double().cpu().tolist()  # one host transfer for the whole run
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    del opt
    return losses, times, peak


def params_rel_diff(a, b) -> float:
    """Maximum over parameters of ||a - b|| / ||a|| (float64)."""
    worst = 0.0
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        pa, pb = pa.detach().double(), pb.detach().double()
        worst = max(worst, ((pa - pb).norm() / pa.norm().clamp_min(1e-30)).item())
    return worst


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps (default: 200 on CUDA, 60 on CPU)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default: 8)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sequence (default: 1024 on CUDA, 64 on CPU)")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default: 4 on CUDA, 2 on CPU)")
    parser.add_argument("--lr", type=float, default=None,
                        help="peak learning rate (default: 5e-4 on CUDA, 3e-3 on CPU)")
    parser.add_argument("--warmup", type=int, default=10, help="linear warm-up steps (default: 10)")
    parser.add_argument("--branching", type=int, default=4,
                        help="successors per token of the Markov chain (default: 4)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="parameter dtype (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--no-aux-loss", action="store_true",
                        help="train without the router load-balancing loss")
    parser.add_argument("--baseline-experts", choices=["default", "eager", "grouped_mm"],
                        default="default",
                        help="transformers experts implementation of the baseline run "
                             "(default: transformers' own default)")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="float32 only: relative tolerance of every loss of the first "
                             "--exact-steps steps (default: 1e-4)")
    parser.add_argument("--exact-steps", type=int, default=60,
                        help="float32 only: steps checked against --tolerance (default: 60)")
    parser.add_argument("--final-tolerance", type=float, default=5e-2,
                        help="relative tolerance of the mean loss of the last 10%% of the steps "
                             "(default: 5e-2)")
    parser.add_argument("--log-every", type=int, default=None,
                        help="print the losses every N steps (default: steps/10)")
    parser.add_argument("--recompute", action="store_true",
                        help="moe_ops.set_recompute(True): recompute the SwiGLU pre-activation in "
                             "the backward instead of saving it (less memory, slower)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.recompute:
        moe_ops.set_recompute(True)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    for flag in ("steps", "batch", "seq_len", "layers", "log_every", "branching"):
        v = getattr(args, flag)
        if v is not None and v < 1:   # 0 must not fall back to the default below
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    if args.lr is not None and args.lr <= 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    device = args.device
    gpu = device == "cuda"
    steps = args.steps or (200 if gpu else 60)
    batch = args.batch or 8
    seq_len = args.seq_len or (1024 if gpu else 64)
    lr = args.lr or (5e-4 if gpu else 3e-3)
    log_every = args.log_every or max(1, steps // 10)
    if steps < 1 or batch < 1 or seq_len < 2:
        parser.error("--steps and --batch must be >= 1, --seq-len >= 2")

    import transformers

    base = build_model(device, args.layers, not args.no_aux_loss, args.seed,
                       getattr(torch, args.dtype) if args.dtype else None)
    cfg = base.config
    exact = base.dtype == torch.float32
    hf_model = copy.deepcopy(base)
    if args.baseline_experts != "default":
        hf_model.set_experts_implementation(args.baseline_experts)
    moe_model = apply_moe_ops(copy.deepcopy(base))
    del base
    hf_experts = getattr(hf_model.config, "_experts_implementation", None) or "eager"

    g = torch.Generator().manual_seed(args.seed + 1)
    probs = markov_chain(cfg.vocab_size, min(args.branching, cfg.vocab_size), g)
    batches = sample_batches(probs, steps, batch, seq_len, g)
    floor = entropy_rate(probs)

    n_params = sum(p.numel() for p in hf_model.parameters())
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name()})" if gpu else ""))
    print(f"Mixtral-architecture model, random init: {cfg.num_hidden_layers} layers, hidden "
          f"{cfg.hidden_size}, intermediate {cfg.intermediate_size}, {cfg.num_local_experts} experts "
          f"top-{cfg.num_experts_per_tok}, vocab {cfg.vocab_size}, {n_params / 1e6:,.2f}M parameters, "
          f"{hf_model.dtype}" + (" (float32 master weights and AdamW state)" if not exact else ""))
    print(f"{steps} steps x {batch} sequences x {seq_len} tokens; AdamW lr {lr:g} ({args.warmup} "
          f"warm-up steps), grad clip 1.0; aux loss "
          + ("off" if args.no_aux_loss else f"on (coef {cfg.router_aux_loss_coef:g})"))
    print(f"data: random Markov chain, {args.branching} successors per token; ln(vocab) = "
          f"{math.log(cfg.vocab_size):.3f}, entropy rate = {floor:.3f} nats/token")
    print(f'baseline: transformers, experts implementation "{hf_experts}"; '
          f"moe_ops: apply_moe_ops (moe.route + moe.dispatch)\n")

    runs = {}
    for name, model in (("transformers", hf_model), ("moe_ops", moe_model)):
        t0 = time.perf_counter()
        runs[name] = train(model, batches, device, lr, args.warmup)
        print(f"  trained {name:<12} in {time.perf_counter() - t0:6.1f} s")
    (hf_loss, hf_t, hf_peak), (mo_loss, mo_t, mo_peak) = runs["transformers"], runs["moe_ops"]

    rel = [abs(b - a) / abs(a) for a, b in zip(hf_loss, mo_loss)]
    print(f"\n{'step':>6} {'transformers':>13} {'moe_ops':>13} {'rel diff':>10}")
    for i in range(steps):
        if i % log_every == 0 or i == steps - 1:
            print(f"{i + 1:>6} {hf_loss[i]:>13.6f} {mo_loss[i]:>13.6f} {rel[i]:>10.2e}")

    tail = max(1, steps // 10)
    hf_tail, mo_tail = statistics.fmean(hf_loss[-tail:]), statistics.fmean(mo_loss[-tail:])
    tail_rel = abs(mo_tail - hf_tail) / abs(hf_tail)
    max_rel = max(rel)
    print(f"\nmax relative difference of the losses over {steps} steps: {max_rel:.2e} "
          f"(at step {rel.index(max_rel) + 1})")
    print(f"mean loss of the last {tail} steps: transformers {hf_tail:.4f}, moe_ops {mo_tail:.4f} "
          f"(relative difference {tail_rel:.2e}; first step {hf_loss[0]:.4f}, entropy rate "
          f"{floor:.3f})")
    print("final parameters, max relative difference over tensors: "
          f"{params_rel_diff(hf_model, moe_model):.2e}")

    timed = slice(TIMING_WARMUP, None) if steps > 2 * TIMING_WARMUP else slice(None)
    hf_med, mo_med = statistics.median(hf_t[timed]), statistics.median(mo_t[timed])
    tokens = batch * seq_len
    print("\nmedian step time (forward + backward + optimizer"
          + (f", steps after the first {TIMING_WARMUP}" if timed.start else "") + "):")
    for name, med, peak in (("transformers", hf_med, hf_peak), ("moe_ops", mo_med, mo_peak)):
        mem = f", peak memory {peak / 2**30:.2f} GiB" if peak is not None else ""
        print(f"  {name:<12} {med * 1e3:9.2f} ms  ({tokens / med:>12,.0f} tokens/s{mem})")
    print(f"  moe_ops speed-up over transformers \"{hf_experts}\": x{hf_med / mo_med:.2f}")
    if not gpu:
        print("(CPU: a tiny model on the ops' torch reference; the times are a smoke test, "
              "not a benchmark)")

    if hf_tail > 0.8 * hf_loss[0]:
        print(f"warning: the loss barely fell ({hf_loss[0]:.3f} -> {hf_tail:.3f}); try more --steps "
              "or a higher --lr")
    checks = [(tail_rel <= args.final_tolerance,
               f"mean loss of the last {tail} steps within {args.final_tolerance:g} relative "
               f"({tail_rel:.2e})")]
    if exact and args.exact_steps > 0:
        n = min(steps, args.exact_steps)
        worst = max(rel[:n])
        checks.append((worst <= args.tolerance,
                       f"every loss of the first {n} steps within {args.tolerance:g} relative "
                       f"({worst:.2e}, float32)"))
    print()
    for ok, what in checks:
        print(f"{'PASS' if ok else 'FAIL'}: {what}")
    if not all(ok for ok, _ in checks):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
