"""A Mixture-of-Experts layer (router + SwiGLU experts) on moe_ops, checked against plain PyTorch
and timed against it. CPU: tiny sizes, runs the torch reference (or the Triton kernels through
the interpreter with TRITON_INTERPRET=1). CUDA: a Mixtral-sized layer on the Triton kernels.

    python examples/quickstart.py [--device cuda] [--tokens 512]
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import moe_ops


class MoE(nn.Module):
    """Router + experts in the contract's layout: w13 [E, 2I, H] (gate rows first), w2 [E, H, I]."""

    def __init__(self, H, I, E, K, dtype, device):
        super().__init__()
        self.K = K
        self.gate = nn.Linear(H, E, bias=False, dtype=dtype, device=device)
        self.w13 = nn.Parameter(torch.randn(E, 2 * I, H, dtype=dtype, device=device) * 0.02)
        self.w2 = nn.Parameter(torch.randn(E, H, I, dtype=dtype, device=device) * 0.02)

    def forward(self, x):
        weights, ids = moe_ops.route(self.gate(x), self.K)
        return moe_ops.dispatch(x, self.w13, self.w2, weights, ids)

    def forward_torch(self, x):
        """The same layer in plain PyTorch: softmax router, top-k, per-expert loop."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = probs.topk(self.K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        I = self.w2.shape[2]
        for e in range(self.w13.shape[0]):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            z = x[tok] @ self.w13[e].t()
            y = (F.silu(z[:, :I]) * z[:, I:]) @ self.w2[e].t()
            out.index_add_(0, tok, y.float() * weights[tok, slot, None])
        return out.to(x.dtype)


def bench(fn, device, reps):
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=["cpu", "cuda"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=None)
    args = p.parse_args()
    if args.tokens is not None and args.tokens < 1:   # 0 must not fall back to the default
        p.error(f"--tokens must be >= 1, got {args.tokens}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device")
    torch.manual_seed(0)
    if args.device == "cuda":
        H, I, E, K, T, dtype, tol = 4096, 14336, 8, 2, args.tokens or 512, torch.bfloat16, 2e-2
    else:
        H, I, E, K, T, dtype, tol = 64, 96, 8, 2, args.tokens or 32, torch.float32, 1e-5
    layer = MoE(H, I, E, K, dtype, args.device)
    x = torch.randn(T, H, dtype=dtype, device=args.device)
    with torch.no_grad():
        out = layer(x)
        ref = layer.forward_torch(x)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        print(f"T={T} H={H} I={I} E={E} K={K} {dtype} on {args.device}: "
              f"relative error vs plain PyTorch {err:.2e} (bound {tol:.0e})")
        assert err <= tol, "moe_ops disagrees with plain PyTorch"
        reps = 20 if args.device == "cuda" else 5
        t_moe = bench(lambda: layer(x), args.device, reps)
        t_ref = bench(lambda: layer.forward_torch(x), args.device, reps)
    print(f"moe_ops {t_moe:.3f} ms | plain PyTorch {t_ref:.3f} ms | speedup {t_ref / t_moe:.2f}x")
    # Training works too: gradients for the router and both expert weights.
    x.requires_grad_(True)
    layer(x).float().square().mean().backward()
    print("grad norms:", {n: f"{p.grad.float().norm().item():.3e}" for n, p in layer.named_parameters()})


if __name__ == "__main__":
    main()
