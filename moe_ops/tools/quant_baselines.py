"""Quantized expert weights for moe-ops-bench `--weights` (issue 42): the formats, random
quantized weights, dequantization into dense copies, the rowwise-FP8 `torch._scaled_grouped_mm`
pipeline and the FP8 matmul ceiling.

Formats (moe.dispatch's layouts, docs/contract.md):
- `fp8`: W8A8, float8_e4m3fn weights with float32 scales per [128, 128] block, the activations
  quantized per token and 128 columns inside the kernels;
- `fp8-w8a16`: the same weights, activations in hidden's dtype;
- `mxfp4`: gpt-oss's MXFP4, uint8 e2m1 pairs with uint8 e8m0 scales per 32 values (W4A16)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from moe_ops.reference.quant import FP8_MAX, dequantize_weights
from moe_ops.tools.baselines import sort_by_expert

BLOCK_SHAPE = [128, 128]


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    name: str                 # the --weights value
    fmt: str                  # "fp8" | "mxfp4": the weight dtype's format
    quantize_activations: bool
    tol: float                # moe_ops vs float64 on the dequantized weights, unquantized activations
    w8a8_tol: Optional[float]  # moe_ops vs the W8A8 reference (activations quantized as the kernels)
    fp8_mma: bool             # the MMAs run in FP8: the FLOP floor is charged at the FP8 ceiling
    mxfp4_layout: str = "plain"   # MXFP4: moe.dispatch's mxfp4_layout ("mma": swizzle_mxfp4)

    def dispatch_kwargs(self, w13_scale, w2_scale) -> dict:
        """moe.dispatch's quantization arguments."""
        kw = dict(w13_scale=w13_scale, w2_scale=w2_scale,
                  block_shape=list(BLOCK_SHAPE) if self.fmt == "fp8" else None,
                  quantize_activations=self.quantize_activations)
        if self.mxfp4_layout != "plain":
            kw["mxfp4_layout"] = self.mxfp4_layout
        return kw


# Tolerances: docs/contract.md's accuracy bounds.
FORMATS = {
    "fp8": QuantFormat("fp8", "fp8", True, 6e-2, 1e-2, True),
    "fp8-w8a16": QuantFormat("fp8-w8a16", "fp8", False, 2e-2, None, False),
    "mxfp4": QuantFormat("mxfp4", "mxfp4", False, 1e-2, None, False),
    # the same weights in the mma layout (moe_ops.mxfp4_layout; H and I multiples of 64)
    "mxfp4-mma": QuantFormat("mxfp4-mma", "mxfp4", False, 1e-2, None, False, "mma"),
}
# Rowwise FP8: the block-scaled weights are rounded to e4m3 a second time (per output row) and
# the activations per whole token, on top of what W8A8 rounds: an emulation in float64 at the
# Qwen3-30B-A3B shape (E=16 of its experts, T=64) came out 6.3e-2 against float64, where the W8A8
# reference is 4.4e-2. Its bound is therefore looser than moe_ops' 6e-2.
SCALED_GROUPED_MM_TOL = 1e-1


def random_quantized(E: int, H: int, I: int, fmt: str, device, g: torch.Generator):
    """(w13, w2, w13_scale, w2_scale) with random bits: FP8 e4m3 bytes below 0x78 (|v| < 256,
    no NaN) with scales in [0, 2e-4) (weights ~ 0.01); MXFP4 random nibbles with e8m0 scales
    2^-9 .. 2^-6."""
    kw = dict(device=device, dtype=torch.uint8, generator=g)
    if fmt == "fp8":
        def e4m3(*shape):
            return torch.randint(0, 0x78, shape, **kw).bitwise_or_(
                torch.randint(0, 2, shape, **kw) << 7).view(torch.float8_e4m3fn)

        bn, bk = BLOCK_SHAPE
        q13, q2 = e4m3(E, 2 * I, H), e4m3(E, H, I)
        s13 = torch.rand(E, -(-2 * I // bn), -(-H // bk), device=device, generator=g) * 2e-4
        s2 = torch.rand(E, -(-H // bn), -(-I // bk), device=device, generator=g) * 2e-4
        return q13, q2, s13, s2
    if H % 32 or I % 32:
        raise ValueError(f"MXFP4 needs H and I multiples of 32, got H={H} I={I}")
    b13 = torch.randint(0, 256, (E, 2 * I, H // 2), **kw)
    b2 = torch.randint(0, 256, (E, H, I // 2), **kw)
    s13 = torch.randint(118, 122, (E, 2 * I, H // 32), **kw)
    s2 = torch.randint(118, 122, (E, H, I // 32), **kw)
    return b13, b2, s13, s2


def quantized_bytes_per_expert(fmt: str, H: int, I: int) -> int:
    """Bytes of one expert's quantized w13 + w2 with their scales."""
    if fmt == "fp8":
        bn, bk = BLOCK_SHAPE
        scales = (-(-2 * I // bn)) * (-(-H // bk)) + (-(-H // bn)) * (-(-I // bk))
        return 3 * H * I + 4 * scales
    return 3 * H * I // 2 + 3 * H * I // 32


def dequantize(w: torch.Tensor, scale: torch.Tensor, block_shape, dtype: torch.dtype,
               chunk_bytes: int = 1 << 30) -> torch.Tensor:
    """Dense [E, N, K] `dtype` copy of a quantized weight, computed in float32 a chunk of experts
    at a time (the float32 intermediates of every expert would not fit next to the weights at
    DeepSeek-V3's shape)."""
    E, N = w.shape[:2]
    K = w.shape[2] * (2 if w.dtype == torch.uint8 else 1)
    out = torch.empty(E, N, K, dtype=dtype, device=w.device)
    step = max(1, chunk_bytes // (4 * 4 * N * K))   # ~4 float32 temporaries per element
    for e in range(0, E, step):
        out[e:e + step] = dequantize_weights(w[e:e + step], scale[e:e + step], block_shape,
                                             torch.float32)
    return out


def rowwise_fp8(w: torch.Tensor, chunk_bytes: int = 1 << 30):
    """(float8_e4m3fn [E, N, K], float32 [E, N]) of a dense [E, N, K] weight: one scale per
    output row, amax / 448 (what torch._scaled_grouped_mm's rowwise recipe takes)."""
    E, N, K = w.shape
    q = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty(E, N, dtype=torch.float32, device=w.device)
    step = max(1, chunk_bytes // (3 * 4 * N * K))
    for e in range(0, E, step):
        wf = w[e:e + step].float()
        se = wf.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
        q[e:e + step] = (wf / se[..., None]).to(torch.float8_e4m3fn)
        s[e:e + step] = se
    return q, s


def _rowwise_activations(a: torch.Tensor):
    s = a.float().abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    return (a.float() / s[:, None]).to(torch.float8_e4m3fn), s


def scaled_grouped_mm_moe(hidden, q13, s13, q2, s2, topk_weights, topk_ids, *, activation="silu",
                          gate_up_interleaved=False, w13_bias=None, w2_bias=None, alpha=1.702,
                          limit=7.0):
    """Rowwise-FP8 MoE on torch._scaled_grouped_mm: tokens sorted by expert (offsets by binary
    search: no host sync, capturable), activations quantized per row, gate+up, bias and
    activation in float32, quantize, down, bias, weighted float32 scatter-add. q13 [E, 2I, H] /
    q2 [E, H, I] float8_e4m3fn with s13 [E, 2I] / s2 [E, H] float32 (rowwise_fp8)."""
    T = topk_ids.shape[0]
    sorted_ids, perm, token_idx, offs = sort_by_expert(topk_ids, q13.shape[0])
    xq, xs = _rowwise_activations(hidden.index_select(0, token_idx))
    h = torch._scaled_grouped_mm(xq, q13.transpose(1, 2), xs, s13, offs=offs,
                                 out_dtype=torch.bfloat16).float()
    if w13_bias is not None:
        h = h + w13_bias.index_select(0, sorted_ids).float()
    I = h.shape[1] // 2
    g, u = (h[:, 0::2], h[:, 1::2]) if gate_up_interleaved else (h[:, :I], h[:, I:])
    if activation == "swiglu_oai":
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        a = (u + 1) * g * torch.sigmoid(alpha * g)
    elif activation == "silu":
        a = F.silu(g) * u
    else:
        raise ValueError(f"scaled_grouped_mm_moe: activation {activation!r} not implemented")
    aq, as_ = _rowwise_activations(a)
    y = torch._scaled_grouped_mm(aq, q2.transpose(1, 2), as_, s2, offs=offs,
                                 out_dtype=torch.bfloat16).float()
    if w2_bias is not None:
        y = y + w2_bias.index_select(0, sorted_ids).float()
    y = y * topk_weights.reshape(-1).index_select(0, perm).float()[:, None]
    out = torch.zeros(T, hidden.shape[1], device=hidden.device, dtype=torch.float32)
    out.index_add_(0, token_idx, y)
    return out.to(hidden.dtype)


_SGMM_PROBE: dict = {}


def scaled_grouped_mm_status(device: torch.device) -> tuple[bool, str]:
    """(usable, reason) for torch._scaled_grouped_mm with rowwise scales on this device, found
    by running it once on a tiny problem (CUDA sm_90+ in current torch; no CPU kernel)."""
    key = str(device)
    if key not in _SGMM_PROBE:
        if not hasattr(torch, "_scaled_grouped_mm"):
            _SGMM_PROBE[key] = (False, f"torch {torch.__version__} has no _scaled_grouped_mm")
        else:
            try:
                g = torch.Generator(device=device).manual_seed(0)
                x = torch.randn(32, 64, device=device, generator=g)
                w = torch.randn(2, 32, 64, device=device, generator=g)
                xq, xs = _rowwise_activations(x)
                wq, ws = rowwise_fp8(w)
                offs = torch.tensor([16, 32], device=device, dtype=torch.int32)
                y = torch._scaled_grouped_mm(xq, wq.transpose(1, 2), xs, ws, offs=offs,
                                             out_dtype=torch.bfloat16).float()
                ref = torch.cat([x[:16] @ w[0].t(), x[16:] @ w[1].t()])
                err = ((y - ref).norm() / ref.norm()).item()
                _SGMM_PROBE[key] = (err < 0.1, "" if err < 0.1 else f"probe error {err:.2e}")
            except Exception as exc:  # noqa: BLE001 - any failure means "not available here"
                msg = str(exc).strip().splitlines()[0].split(". ")[0][:100] if str(exc).strip() else ""
                _SGMM_PROBE[key] = (False, f"{type(exc).__name__}: {msg}")
    return _SGMM_PROBE[key]


def fp8_matmul_rate(device: torch.device, timer, n: int) -> float:
    """FLOP/s of torch._scaled_mm on n^3 e4m3 operands (tensor-wise scales, bf16 out), the best
    of three timings."""
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    return max(2 * n ** 3 / (timer(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                                             out_dtype=torch.bfloat16)) * 1e-3)
               for _ in range(3))
