"""MXFP4 weights rearranged for Hopper's wgmma register operand (the "mma" layout).

The plain layout is transformers' `*_blocks` flattened: `w [E, N, K // 2]` uint8, two e2m1 values
per byte along the reduction, low nibble first. The MXFP4 kernels decode a weight tile in
registers and give it to wgmma as its left operand, which Hopper reads from registers in a fixed
fragment: in each 16-row group of the tile, lane `4 * r + t` (`r` in 0..7, `t` in 0..3) holds, per
16 reduction values, the bf16 pairs `(r, 2t)`, `(r + 8, 2t)`, `(r, 2t + 8)`, `(r + 8, 2t + 8)`, one
packed byte each. Loaded in the plain layout, those bytes come from four places and the decoded
tile goes through shared memory to reach that fragment.

`swizzle_mxfp4` permutes the bytes of every 16-row x 32-byte block (16 rows x 64 values) so
that each lane's 16 bytes of that block are contiguous, in fragment order (one vector load), and
re-encodes each 4-byte word's eight codes so that shifts and masks place them in bf16 bit
positions with no byte extraction (`_twiddle`). The result has the plain tensor's shape and
size (`[E, N, K // 2]` uint8, contiguous); only the byte order within blocks differs.
`unswizzle_mxfp4` inverts it exactly. Needs `N % 16 == 0` and `K % 64 == 0` (gpt-oss: N 5760 and
2880, K 2880).

Byte map (inverse of the kernel's unshuffle, quant_gemm.mxfp4_mma_tile): logical row
`n = 16a + 8g + 2b + d` and byte `kb = 32c + 4f + e` go to storage row `4a + b` (of `N / 4` rows of
`2K` bytes) and column `128c + 64d + 16e + 2f + g`."""
from __future__ import annotations

import torch

# the logical [N, K // 2] byte matrix viewed as (a, g, b, d | c, f, e) and its storage order
# (a, b | c, d, e, f, g)
_ROWS = (2, 4, 2)       # g, b, d within a 16-row group
_COLS = (8, 4)          # f, e within a 32-byte chunk


def _check(w: torch.Tensor, name: str) -> None:
    if not isinstance(w, torch.Tensor) or w.dtype != torch.uint8 or w.dim() != 3:
        raise TypeError(f"{name} must be a uint8 [E, N, K // 2] MXFP4 tensor, got "
                        f"{getattr(w, 'dtype', type(w))} {tuple(getattr(w, 'shape', ()))}")
    E, N, KB = w.shape
    if N % 16 or KB % 32:
        raise ValueError(f"{name}: the mma layout needs N % 16 == 0 and K % 64 == 0 (K // 2 % 32 "
                         f"== 0), got N={N}, K // 2={KB}")


def _permute(w: torch.Tensor) -> torch.Tensor:
    E, N, KB = w.shape
    v = w.reshape(E, N // 16, *_ROWS, KB // 32, *_COLS)      # E a g b d c f e
    v = v.permute(0, 1, 3, 5, 4, 7, 6, 2)                      # E a b c d e f g
    return v.reshape(E, N, KB)


def _unpermute(s: torch.Tensor) -> torch.Tensor:
    E, N, KB = s.shape
    v = s.reshape(E, N // 16, 4, KB // 32, 2, 4, 8, 2)         # E a b c d e f g
    v = v.permute(0, 1, 7, 2, 4, 3, 6, 5)                      # E a g b d c f e
    return v.reshape(E, N, KB)


# Each 4-byte word (bytes p0..p3, each two codes: low nibble, high nibble) is re-encoded so that
# the 16-bit halves hold, at bf16 bit positions: p0's codes at bits 15 (sign) and 8..6, p1's at
# 12 and 5..3, p2's at 9 and 2..0, p3's sign at 14, exponent at 11..10, mantissa at 13. Then
# (x & M), (x << 3) & M, (x << 6) & M and one gather of p3's bits give four bf16x2 registers
# whose values are the codes times 2^-126 (quant_gemm.mxfp4_mma_tile).
def _spread(p: torch.Tensor) -> torch.Tensor:
    """Byte -> a 32-bit word (held in int64: logical shifts) with its low nibble in the low
    16-bit half, high nibble in the high half."""
    p = p.to(torch.int64)
    return (p & 0xF) | ((p & 0xF0) << 12)


def _twiddle(words: torch.Tensor) -> torch.Tensor:
    """[..., 4] uint8 -> the re-encoded [..., 4] uint8 (little-endian int32 words)."""
    x0, x1, x2, x3 = (_spread(words[..., i]) for i in range(4))

    def first(x):   # sign to bit 15, exponent and mantissa to bits 8..6 (per half)
        return ((x & 0x00080008) << 12) | ((x & 0x00070007) << 6)
    w = first(x0) | (first(x1) >> 3) | (first(x2) >> 6)
    w |= ((x3 & 0x00080008) << 11) | ((x3 & 0x00060006) << 9) | ((x3 & 0x00010001) << 13)
    return torch.stack([(w >> (8 * i)) & 0xFF for i in range(4)], dim=-1).to(torch.uint8)


def _untwiddle(words: torch.Tensor) -> torch.Tensor:
    w = torch.zeros(words.shape[:-1], dtype=torch.int64, device=words.device)
    for i in range(4):
        w |= words[..., i].to(torch.int64) << (8 * i)

    def code(h):   # a 16-bit half at the first byte's positions -> e2m1 code
        return (((h >> 15) & 1) << 3) | ((h >> 6) & 7)

    def byte(x):   # an int32 word at the first byte's positions -> that byte
        return code(x & 0xFFFF) | (code((x >> 16) & 0xFFFF) << 4)
    m = 0xFFFFFFFF
    fourth = (((w << 1) & 0x80008000) | ((w >> 3) & 0x01800180) | ((w >> 7) & 0x00400040))
    out = [byte(w), byte((w << 3) & m), byte((w << 6) & m), byte(fourth)]
    return torch.stack(out, dim=-1).to(torch.uint8)


def swizzle_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """The mma layout of plain MXFP4 weights `w [E, N, K // 2]` uint8 (module docstring): a new
    contiguous tensor of the same shape, dtype and device. Scales are unchanged (`[E, N, K // 32]`
    as before)."""
    _check(w, "w")
    E, N, KB = w.shape
    out = torch.empty(E, N, KB, dtype=torch.uint8, device=w.device)
    for e in range(E):   # one expert at a time: the int64 temporaries stay small
        s = _permute(w[e:e + 1])
        out[e] = _twiddle(s.reshape(N, KB // 4, 4)).reshape(N, KB)
    return out


def unswizzle_mxfp4(s: torch.Tensor) -> torch.Tensor:
    """The plain layout of mma-layout MXFP4 weights (the inverse of swizzle_mxfp4)."""
    _check(s, "w")
    E, N, KB = s.shape
    out = torch.empty(E, N, KB, dtype=torch.uint8, device=s.device)
    for e in range(E):
        plain = _untwiddle(s[e].reshape(N, KB // 4, 4)).reshape(1, N, KB)
        out[e] = _unpermute(plain)[0]
    return out
