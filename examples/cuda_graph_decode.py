"""Greedy decoding of a transformers Mixtral patched by moe_ops, one CUDA-graph replay per token.

A Mixtral-architecture model is built from a config with random weights (nothing is downloaded):
on a GPU, 2 layers at full Mixtral width (H=4096, I=14336, 8 experts, top-2) in bfloat16; on CPU,
a tiny float32 one. It decodes greedily with a transformers `StaticCache` three ways:

1. eager transformers (its own experts implementation, e.g. "grouped_mm"),
2. the same model patched by `moe_ops.integrations.huggingface.apply_moe_ops` (router ->
   `torch.ops.moe.route`, experts -> `torch.ops.moe.dispatch`), still eager,
3. the patched model's decode step captured once as a `torch.cuda.CUDAGraph` and replayed once
   per token (on CPU the same static-buffer step runs eagerly: there is no graph to capture).

It prints tokens/s for each and checks that the generated tokens agree. Where two runs part, the
check accepts it only at a near tie: the two tokens' logits in the first run must be closer than
twice the largest logit difference between the runs at that step (bf16 kernels that sum in a
different order can flip such a tie, and the sequences then legitimately continue differently).

    python examples/cuda_graph_decode.py                  # GPU if there is one, else tiny CPU model
    python examples/cuda_graph_decode.py --new-tokens 128 --batch 4

Why this works: moe.route and moe.dispatch never synchronise with the host and size every buffer
from shapes, and the StaticCache keeps its keys, values and length counter in fixed device tensors
that the graph updates in place, so one captured step serves every position.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import sys
import time

import torch

import moe_ops  # noqa: F401  (registers torch.ops.moe.*)
from moe_ops.integrations.huggingface import apply_moe_ops

try:
    import transformers
    from transformers import MixtralConfig, MixtralForCausalLM, StaticCache
except ImportError:  # pragma: no cover
    sys.exit("this example needs transformers 5.x: pip install 'transformers>=5'")


# --------------------------------------------------------------------------------------------
# Model and cache


def mixtral_config(device: torch.device, layers: int) -> MixtralConfig:
    if device.type == "cuda":
        # Mixtral-8x7B's layer shapes; only the depth is cut (2 layers: ~5.6 GB of experts in bf16).
        return MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                             num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                             num_local_experts=8, num_experts_per_tok=2,
                             max_position_embeddings=4096)
    return MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                         num_experts_per_tok=2, max_position_embeddings=512)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def build_model(device: torch.device, dtype: torch.dtype, layers: int, seed: int):
    torch.manual_seed(seed)
    # Built in place on the device and in the dtype: a full-width fp32 copy on the host would
    # need ~12 GB and a minute of random init.
    with torch.device(device), default_dtype(dtype):
        model = MixtralForCausalLM(mixtral_config(device, layers))
    return model.eval()


def make_static_cache(model, max_cache_len: int, batch: int):
    """A StaticCache for `model`. transformers 5.x takes (config, max_cache_len) and allocates each
    layer lazily, at its first update, with the dtype/device/batch of the keys it sees (so the
    prefill, run eagerly, allocates it before any capture). 4.x-style signatures also took the
    batch size, device and dtype: pass those when this version asks for them."""
    params = inspect.signature(StaticCache.__init__).parameters
    kwargs = {"config": model.config, "max_cache_len": max_cache_len}
    p = next(model.parameters())
    for name, value in (("max_batch_size", batch), ("batch_size", batch), ("device", p.device),
                        ("dtype", p.dtype)):
        if name in params:
            kwargs[name] = value
    return StaticCache(**kwargs)


def cache_keyword(model) -> str:
    # transformers 5.24 renamed `past_key_values=` to `cache=` (the old name warns until 5.40).
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# --------------------------------------------------------------------------------------------
# Decoding


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_last_logits(model, ids: torch.Tensor, cache, cache_kw: str) -> torch.Tensor:
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_kw: cache})
    return out.logits[:, -1, :].float()


def prefill(model, prompt, cache, cache_kw):
    logits = forward_last_logits(model, prompt, cache, cache_kw)
    return logits, logits.argmax(-1, keepdim=True)


class Run:
    """One greedy decode: tokens [N, B] and the logits [N, B, V] that chose them, on the device."""

    def __init__(self, name, n_steps, batch, vocab, device):
        self.name = name
        self.tokens = torch.empty(n_steps, batch, dtype=torch.long, device=device)
        self.logits = torch.empty(n_steps, batch, vocab, dtype=torch.float32, device=device)
        self.decode_seconds = float("nan")
        self.decode_tokens = (n_steps - 1) * batch  # the first token comes from the prefill

    def record(self, i, logits, ids):
        # Device-to-device copies: the loops never wait for the GPU.
        self.logits[i].copy_(logits)
        self.tokens[i].copy_(ids.view(-1))

    @property
    def tokens_per_s(self):
        return self.decode_tokens / self.decode_seconds


def decode_eager(name, model, prompt, n_steps, cache_kw, max_cache_len):
    """Prefill, then one eager forward per token."""
    device, (batch, _) = prompt.device, prompt.shape
    run = Run(name, n_steps, batch, model.config.vocab_size, device)
    cache = make_static_cache(model, max_cache_len, batch)
    logits, ids = prefill(model, prompt, cache, cache_kw)
    run.record(0, logits, ids)
    sync(device)
    t0 = time.perf_counter()
    for i in range(1, n_steps):
        logits = forward_last_logits(model, ids, cache, cache_kw)
        ids = logits.argmax(-1, keepdim=True)
        run.record(i, logits, ids)
    sync(device)
    run.decode_seconds = time.perf_counter() - t0
    return run


class DecodeStep:
    """One greedy decode step over static buffers: reads the token in `ids` [B, 1], appends its
    keys/values to the StaticCache (which advances its own on-device length counter), and writes
    the logits of the next token to `logits` and that token back into `ids`. With nothing read
    from the host, the step is the same at every position, so it is captured once and replayed."""

    def __init__(self, model, cache, first_ids, cache_kw):
        self.model, self.cache, self.cache_kw = model, cache, cache_kw
        self.ids = first_ids.clone()
        self.logits = None
        self.graph = None

    def _step(self):
        logits = forward_last_logits(self.model, self.ids, self.cache, self.cache_kw)
        self.ids.copy_(logits.argmax(-1, keepdim=True))
        return logits

    def capture(self):
        """Records the step into a CUDA graph. Capture only records kernels: the cache does not
        move. Kernels must have been compiled and cuBLAS initialised before (see warm_up)."""
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step()

    def __call__(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            self.logits = self._step()
        return self.logits, self.ids


def warm_up(model, prompt, cache_kw, max_cache_len, steps=3):
    """Runs a few decode steps on a side stream with a scratch cache, as CUDA graph capture asks:
    Triton kernels compiled, cuBLAS handles and workspaces created for the capturing stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        scratch = make_static_cache(model, max_cache_len, prompt.shape[0])
        _, ids = prefill(model, prompt, scratch, cache_kw)
        step = DecodeStep(model, scratch, ids, cache_kw)
        for _ in range(steps):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    sync(prompt.device)


def decode_graph(name, model, prompt, n_steps, cache_kw, max_cache_len):
    """Prefill eagerly (it allocates the StaticCache), capture one decode step, replay per token.
    On CPU the same static-buffer step runs eagerly."""
    device, (batch, _) = prompt.device, prompt.shape
    run = Run(name, n_steps, batch, model.config.vocab_size, device)
    if device.type == "cuda":
        warm_up(model, prompt, cache_kw, max_cache_len)
    cache = make_static_cache(model, max_cache_len, batch)
    logits, ids = prefill(model, prompt, cache, cache_kw)
    run.record(0, logits, ids)
    step = DecodeStep(model, cache, ids, cache_kw)
    if device.type == "cuda":
        step.capture()
    sync(device)
    t0 = time.perf_counter()
    for i in range(1, n_steps):
        logits, ids = step()
        run.record(i, logits, ids)
    sync(device)
    run.decode_seconds = time.perf_counter() - t0
    return run


# --------------------------------------------------------------------------------------------
# Checking


def compare(a: Run, b: Run, rel_tol: float) -> tuple[bool, str]:
    """Whether runs a and b generated the same tokens, up to near ties (see the module doc).
    While the tokens agree, the logits must agree within rel_tol of their largest magnitude."""
    ta, tb = a.tokens.cpu(), b.tokens.cpu()
    ok, notes = True, []
    for r in range(ta.shape[1]):
        differ = (ta[:, r] != tb[:, r]).nonzero()
        n_same = int(differ[0]) if len(differ) else ta.shape[0]
        upto = min(n_same + 1, ta.shape[0])  # the first differing step still saw the same prefix
        la, lb = a.logits[:upto, r].cpu(), b.logits[:upto, r].cpu()
        diff = (la - lb).abs().amax(-1)            # [steps]
        scale = la.abs().amax(-1).clamp_min(1e-6)
        worst = float((diff / scale).max())
        if worst > rel_tol:
            ok = False
            notes.append(f"row {r}: logits differ by {worst:.2e} of their scale (> {rel_tol:.0e})")
        if n_same == ta.shape[0]:
            notes.append(f"row {r}: all {n_same} tokens agree (logits within {worst:.1e})")
            continue
        i = n_same
        x, y = int(ta[i, r]), int(tb[i, r])
        gap = float(la[i, x] - la[i, y])
        tied = gap <= 2 * float(diff[i]) + 1e-6
        ok &= tied
        notes.append(f"row {r}: first {n_same} tokens agree, then {a.name!r} picks {x}, {b.name!r} "
                     f"picks {y}: logit gap {gap:.3g} vs run difference {float(diff[i]):.3g} "
                     f"({'a near tie' if tied else 'NOT a tie'})")
    return ok, "\n    ".join(notes)


# --------------------------------------------------------------------------------------------


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (the first token comes from the prefill)")
    for flag in ("layers", "batch", "prompt_len"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device")

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # bf16 runs that sum in another order can part on a near tie (see the module doc); their
    # logits stay within a few percent of each other. float32 ones within ~1e-5.
    rel_tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
    n_steps = args.new_tokens
    max_cache_len = args.prompt_len + n_steps + 8

    model = build_model(device, dtype, args.layers, args.seed)
    cfg = model.config
    cache_kw = cache_keyword(model)
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len), generator=gen).to(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{where}, torch {torch.__version__}, transformers {transformers.__version__}, {dtype}")
    print(f"Mixtral {cfg.num_hidden_layers} layers, H={cfg.hidden_size} I={cfg.intermediate_size} "
          f"E={cfg.num_local_experts} K={cfg.num_experts_per_tok}, batch {args.batch}, prompt "
          f"{args.prompt_len}, {n_steps} new tokens (timed: the {n_steps - 1} after the prefill)")

    hf_impl = getattr(cfg, "_experts_implementation", None) or "eager"
    with torch.no_grad():
        # Each path runs twice; the second is timed (the first compiles kernels, fills caches).
        decode_eager("warm-up", model, prompt, 4, cache_kw, max_cache_len)
        hf = decode_eager(f"transformers ({hf_impl} experts)", model, prompt, n_steps, cache_kw,
                          max_cache_len)
        apply_moe_ops(model)
        decode_eager("warm-up", model, prompt, 4, cache_kw, max_cache_len)
        ours = decode_eager("transformers + moe_ops", model, prompt, n_steps, cache_kw, max_cache_len)
        label = "moe_ops, CUDA graph per token" if device.type == "cuda" else \
            "moe_ops, static step (no graph on CPU)"
        graph = decode_graph(label, model, prompt, n_steps, cache_kw, max_cache_len)

    print()
    print("| decode path | tokens/s | ms/step |")
    print("|---|---:|---:|")
    for run in (hf, ours, graph):
        print(f"| {run.name} | {run.tokens_per_s:,.1f} | {1e3 * run.decode_seconds / (n_steps - 1):.3f} |")
    print()
    ok1, notes1 = compare(hf, ours, rel_tol)
    ok2, notes2 = compare(ours, graph, rel_tol)
    print(f"tokens, transformers vs moe_ops: {'OK' if ok1 else 'MISMATCH'}\n    {notes1}")
    print(f"tokens, moe_ops eager vs {graph.name}: {'OK' if ok2 else 'MISMATCH'}\n    {notes2}")
    print(f"first tokens of row 0: {graph.tokens[:16, 0].tolist()}")
    if not (ok1 and ok2):
        sys.exit(1)


if __name__ == "__main__":
    main()
