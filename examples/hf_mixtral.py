"""moe_ops on a HuggingFace transformers Mixtral model, in one line: `apply_moe_ops(model)`.

Builds a Mixtral-architecture model from a config with random weights (nothing is downloaded):
a tiny one on CPU, a full-width 2-layer one on CUDA (hidden 4096, intermediate 14336, 8 experts,
top-2, bfloat16). Generates greedily with the unpatched model and with moe_ops, compares the tokens,
and prints prefill and decode tokens/s for the transformers experts implementations "eager" and
"grouped_mm" (when this transformers/torch has it), for moe_ops through transformers' experts
interface (`set_experts_implementation("moe_ops")`: transformers' router, moe.dispatch experts) and
for `apply_moe_ops` (moe.route router and moe.dispatch experts).

    python examples/hf_mixtral.py                      # CUDA if available, else CPU (tiny model)
    python examples/hf_mixtral.py --device cpu --new-tokens 16
    python examples/hf_mixtral.py --device cuda --batch 8 --prompt-len 1024
    python examples/hf_mixtral.py --device cuda --compile   # decode through CUDA graphs

Prefill: one forward over `--batch` prompts of `--prompt-len` tokens. Decode: `generate` steps
after the first new token (timestamped by a streamer), tokens of the whole batch per second. By
default decoding is eager with a dynamic cache: at batch 1 per-token host overheads (Python, kernel
launches) dominate the numbers. `--compile` decodes with a static cache, which transformers'
generate compiles with CUDA graphs (prefill stays eager).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import moe_ops  # noqa: E402,F401  (registers torch.ops.moe.* and the "moe_ops" experts implementation)
from moe_ops._runtime import interpret_enabled  # noqa: E402
from moe_ops.tools.debug import OpCounter  # noqa: E402
from moe_ops.integrations.huggingface import apply_moe_ops, revert_moe_ops  # noqa: E402


def build_model(device: str, layers: int | None, seed: int):
    from transformers import MixtralConfig, MixtralForCausalLM

    if device == "cuda":
        # Mixtral-8x7B widths, `layers` decoder layers, bfloat16.
        config = MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                               num_hidden_layers=layers or 2, num_attention_heads=32,
                               num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                               max_position_embeddings=32768, pad_token_id=0, bos_token_id=1,
                               eos_token_id=2)
        dtype = torch.bfloat16
    else:
        config = MixtralConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                               num_hidden_layers=layers or 2, num_attention_heads=4,
                               num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                               max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
                               eos_token_id=2)
        dtype = torch.float32
    torch.manual_seed(seed)
    with torch.device(device):
        model = MixtralForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats):
    """Median wall time of `fn()` over `repeats` runs (after one warm-up run)."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _TokenClock:
    """A generate() streamer that timestamps every step: put() is called once with the prompt,
    then once per generated token (generate has already synchronised with the device to decide
    whether to stop)."""

    def __init__(self, device):
        self.device, self.times = device, []

    def put(self, value):
        sync(self.device)
        self.times.append(time.perf_counter())

    def end(self):
        pass


def generate(model, ids, new_tokens, streamer=None, static=False):
    kw = dict(cache_implementation="static") if static else {}
    return model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=model.config.pad_token_id, streamer=streamer, **kw)


def measure(model, ids, new_tokens, device, repeats, static=False):
    """(prefill tokens/s, decode tokens/s, generated tokens)."""
    batch, prompt = ids.shape
    with torch.no_grad():
        t_prefill = timed(lambda: model(ids, use_cache=True), device, repeats)
        # warm-up (and compilation with --compile), then the tokens compared
        generate(model, ids, new_tokens, static=static)
        tokens = generate(model, ids, new_tokens, static=static)
        decode = []
        for _ in range(repeats):
            clock = _TokenClock(device)
            generate(model, ids, new_tokens, streamer=clock, static=static)
            # times[1]: first new token (after prefill); times[-1]: last new token.
            decode.append((clock.times[-1] - clock.times[1]) / (len(clock.times) - 2))
    return batch * prompt / t_prefill, batch / statistics.median(decode), tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="tokens to generate (default: 32 on CUDA, 16 on CPU)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=None,
                        help="prompt tokens (default: 512 on CUDA, 32 on CPU)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: 2)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs per measurement, median reported (default: 5 on CUDA, 3 on CPU)")
    parser.add_argument("--compile", action="store_true",
                        help="decode with a static cache, which transformers' generate compiles "
                             "(torch.compile, CUDA graphs) on CUDA; prefill stays eager")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    for flag in ("new_tokens", "batch", "prompt_len", "layers", "repeats"):
        v = getattr(args, flag)
        if v is not None and v < 1:   # 0 must not fall back to the default below
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    device = args.device
    new_tokens = args.new_tokens or (32 if device == "cuda" else 16)
    if new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (decode speed is measured past the first token)")
    prompt_len = args.prompt_len or (512 if device == "cuda" else 32)
    repeats = args.repeats or (5 if device == "cuda" else 3)

    import transformers
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    model = build_model(device, args.layers, args.seed)
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else ""))
    print(f"Mixtral-architecture model, random weights: {cfg.num_hidden_layers} layers, hidden "
          f"{cfg.hidden_size}, intermediate {cfg.intermediate_size}, {cfg.num_local_experts} experts "
          f"top-{cfg.num_experts_per_tok}, {n_params / 1e6:,.1f}M parameters, {model.dtype}")
    print(f"batch {args.batch}, prompt {prompt_len} tokens, {new_tokens} new tokens, median of "
          f"{repeats} runs, decode with a " + ("static cache, compiled" if args.compile
                                               else "dynamic cache, eager") + "\n")
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(3, cfg.vocab_size, (args.batch, prompt_len), generator=g).to(device)

    results = []  # (name, prefill tok/s, decode tok/s, tokens, logits)

    def run(name, setup, teardown=None, expect=None):
        """`expect`: the moe ops one forward must call (a patch that did not take effect
        would otherwise be timed and compared as if it had)."""
        setup()
        try:
            with torch.no_grad(), OpCounter() as calls:
                logits = model(ids).logits[:, -1].float()
            want = {op: cfg.num_hidden_layers for op in expect or ()}
            if calls.counts != want:
                raise SystemExit(f"{name}: one forward called torch.ops.moe {calls.counts}, "
                                 f"expected {want}")
            prefill, decode, tokens = measure(model, ids, new_tokens, device, repeats, args.compile)
        finally:
            if teardown is not None:
                teardown()
            if args.compile:  # the next implementation gets a fresh compiled decode step
                model.__dict__.pop("_compiled_call", None)
                torch._dynamo.reset()
        results.append((name, prefill, decode, tokens, logits))
        ops = ", ".join(f"{op} x{n}" for op, n in calls.counts.items()) or "none"
        print(f"  {name:<34} prefill {prefill:>10.1f} tok/s   decode {decode:>8.1f} tok/s   "
              f"(moe ops per forward: {ops})")

    run('transformers "eager"', lambda: model.set_experts_implementation("eager"))
    if "grouped_mm" in ALL_EXPERTS_FUNCTIONS:
        try:
            run('transformers "grouped_mm"', lambda: model.set_experts_implementation("grouped_mm"))
        except Exception as e:  # noqa: BLE001  (not available on this torch/device)
            print(f'  transformers "grouped_mm"          not available: {type(e).__name__}: {e}')
    else:
        print('  transformers "grouped_mm"          not in this transformers')
    run('experts_implementation="moe_ops"', lambda: model.set_experts_implementation("moe_ops"),
        lambda: model.set_experts_implementation("eager"), expect=["dispatch"])
    run("apply_moe_ops (route + dispatch)", lambda: apply_moe_ops(model), lambda: revert_moe_ops(model),
        expect=["route", "dispatch"])

    # Tokens and last-position logits against the unpatched model.
    ref_name, _, _, ref_tokens, ref_logits = results[0]
    print(f"\ngreedy tokens and last-prompt-position logits against {ref_name}:")
    exact = device == "cpu"  # float32 on CPU: the tokens must agree
    ok = True
    for name, _, _, tokens, logits in results[1:]:
        new, ref_new = tokens[:, prompt_len:], ref_tokens[:, prompt_len:]
        same = (new == ref_new).all(dim=0)
        first_diff = int((~same).nonzero()[0]) if not bool(same.all()) else None
        err = ((logits - ref_logits).norm() / ref_logits.norm()).item()
        status = "identical" if first_diff is None else f"first difference at new token {first_diff}"
        print(f"  {name:<34} tokens {status}; logits relative error {err:.2e}")
        ok &= first_diff is None or not exact
    tps = {name: (p, d) for name, p, d, _, _ in results}
    base = tps[ref_name]
    moe = tps["apply_moe_ops (route + dispatch)"]
    print(f"\napply_moe_ops vs {ref_name}: prefill x{moe[0] / base[0]:.2f}, decode x{moe[1] / base[1]:.2f}")
    if 'transformers "grouped_mm"' in tps:
        gm = tps['transformers "grouped_mm"']
        print(f'apply_moe_ops vs transformers "grouped_mm": prefill x{moe[0] / gm[0]:.2f}, '
              f"decode x{moe[1] / gm[1]:.2f}")
    if device == "cpu":
        how = ("Triton kernels in the interpreter" if interpret_enabled()
               else "the ops' torch reference")
        print(f"(CPU: a tiny model running {how}; the speeds are a smoke test, not a benchmark)")
    if not ok:
        raise SystemExit("moe_ops generated different tokens from the unpatched float32 model")


if __name__ == "__main__":
    main()
