"""Which Triton features the installed Triton offers, decided in one place by probing the API
(not by version numbers scattered over the launchers). The launchers ask here before choosing a
path; every path has a fallback that runs on the oldest supported Triton (3.6).

| feature | first seen | used for |
|---|---|---|
| host tensor descriptors (triton.tools.tensor_descriptor) | 3.4 | TMA weight and activation tiles (sm_90+) |
| tl.dot_scaled | 3.3 | an optional MXFP4 path (QuantDispatchConfig.mxfp4_dot_scaled, off by default until measured); the default decodes MXFP4 to bf16 in registers on every version |
| tl.inline_asm_elementwise with PTX `mul.rn.bf16x2` | 3.0 (sm_90 for the instruction) | the MXFP4 pair decode (QuantDispatchConfig.mxfp4_asm_decode) |
| Gluon Hopper TMA load (`async_copy_global_to_shared` / `async_load`) | 3.6 / 3.8 | not used yet |
| Gluon TMA multicast in CTA clusters (`multicast=`) | 3.7 | not used yet |
| warp specialisation (`tl.range(warp_specialize=True)`) | 3.4 | not used: on Triton 3.6 / H200 its kernels returned NaN and stale tiles beside another process using the GPU (docs/design.md) |
| Gluon's explicit warp specialisation (`gl.warp_specialize`, partitions and mbarriers) | 3.6 | not used yet; measured correct on an H100 with 3.6 and 3.9, alone and beside a matmul process (`benchmarks/probe_gluon_ws.py`, docs/design.md) |
| the MXFP4 plain layout's scales loaded a K step ahead (QuantDispatchConfig.prefetch_scales) | - | a compiler property, not an API: bitwise repeatable with 3.6, not with 3.9 (docs/design.md); off where not measured safe |
"""
from __future__ import annotations

import functools
import inspect


@functools.lru_cache(maxsize=None)
def triton_version() -> tuple:
    """(major, minor, patch) of the installed Triton, (0, 0, 0) without one."""
    try:
        import triton
    except ImportError:
        return (0, 0, 0)
    parts = []
    for p in triton.__version__.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (3 - len(parts)))


@functools.lru_cache(maxsize=None)
def host_tensor_descriptors() -> bool:
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def dot_scaled() -> bool:
    try:
        import triton.language as tl
    except ImportError:
        return False
    return hasattr(tl, "dot_scaled")


@functools.lru_cache(maxsize=None)
def gluon_hopper_tma_load() -> str | None:
    """The name of Gluon's Hopper TMA global-to-shared load in this Triton, or None."""
    try:
        from triton.experimental.gluon.language.nvidia.hopper import tma
    except ImportError:
        return None
    for name in ("async_load", "async_copy_global_to_shared"):
        if hasattr(tma, name):
            return name
    return None


@functools.lru_cache(maxsize=None)
def gluon_tma_multicast() -> bool:
    """Whether Gluon's Hopper TMA load takes `multicast=` (CTA clusters)."""
    name = gluon_hopper_tma_load()
    if name is None:
        return False
    from triton.experimental.gluon.language.nvidia.hopper import tma

    try:
        return "multicast" in inspect.signature(getattr(tma, name)).parameters
    except (TypeError, ValueError):
        return False


def inline_ptx(device) -> bool:
    """Whether the MXFP4 pair decode's inline PTX runs on `device`: Triton's
    inline_asm_elementwise and a CUDA GPU of compute capability 9.0 or newer (bf16x2 `mul.rn`)."""
    try:
        import torch
        import triton.language as tl
    except ImportError:
        return False
    if getattr(device, "type", device) != "cuda" or not hasattr(tl, "inline_asm_elementwise"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def warp_specialization_safe() -> bool:
    """Triton's automatic warp specialisation (`tl.range(..., warp_specialize=True)`): False on
    every supported Triton: no warp-specialised kernel ships until one passes the GPU suite
    alone and beside a process running matmuls on the same GPU. A minimal warp-specialised GEMM
    was wrong on 3.6 and again on 3.9.0, even alone (docs/design.md). Gluon's explicit form is
    `gluon_warp_specialize`."""
    return False


@functools.lru_cache(maxsize=None)
def gluon_warp_specialize() -> bool:
    """Whether Gluon offers explicit warp specialisation (`gl.warp_specialize`: partitions with
    their own warps and registers, synchronised by mbarriers). Unlike Triton's automatic form,
    GEMMs written with it computed correctly and bitwise repeatably on an H100 with Triton 3.6
    and 3.9, alone and beside a process running matmuls (`benchmarks/probe_gluon_ws.py`); no
    moe_ops kernel uses it yet."""
    try:
        from triton.experimental.gluon import language as gl
    except ImportError:
        return False
    return hasattr(gl, "warp_specialize")


@functools.lru_cache(maxsize=None)
def mxfp4_plain_scale_prefetch_safe() -> bool:
    """Whether the MXFP4 GEMMs may load the plain layout's e8m0 scales a K step ahead
    (QuantDispatchConfig.prefetch_scales). A property of the compiler, not of its API, so
    decided by the versions measured on a GPU (H100, docs/design.md): with Triton 3.6 every
    call's outputs were bitwise the same (gpt-oss-20b T = 1..2048, alone and beside a matmul
    process); with Triton 3.9 the gate+up kernel's outputs at T = 128 (16-row blocks, 64-wide
    K steps) differed from call to call in a few rows, and not with the prefetch off or with
    the mma layout. 3.7.1 and 3.8 are not measured on a GPU: treated as 3.9."""
    return triton_version() < (3, 7, 0)


def summary() -> dict:
    """Every feature's answer (the benchmark and the bug-report helper print it)."""
    return {"triton": ".".join(map(str, triton_version())),
            "host_tensor_descriptors": host_tensor_descriptors(), "dot_scaled": dot_scaled(),
            "gluon_hopper_tma_load": gluon_hopper_tma_load(),
            "gluon_tma_multicast": gluon_tma_multicast(),
            "warp_specialization_safe": warp_specialization_safe(),
            "gluon_warp_specialize": gluon_warp_specialize(),
            "mxfp4_plain_scale_prefetch_safe": mxfp4_plain_scale_prefetch_safe()}
