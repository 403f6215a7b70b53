"""Launching an already compiled Triton kernel without Triton's per-call argument binding.

A Triton 3.6 launch costs ~33 us of host time on the H200 host for our ~40-parameter GEMM
kernels (benchmarks/NOTES.md, entry 22): the JIT binds every argument, computes its
specialisation (dtype, 16-byte alignment, value 1) and a cache key, then launches. An eager
decode step launches 3-5 of them per MoE layer, several times the GPU work. Here a launch site
passes a `key` that determines that specialisation (the launchers build it from the shapes,
strides, dtypes and pointer alignment of the tensors the call was given, and the config: every
argument they pass is a function of those); the first launch with a key goes through Triton's
JIT and keeps the compiled kernel, later ones call its launcher directly with the arguments in
the kernel's parameter order. MOE_OPS_VERIFY_LAUNCH=1 (the GPU tests set it) also asks Triton's
JIT on every such launch which kernel it would have run, and raises if that is another one.
"""
from __future__ import annotations

import inspect

from moe_ops._runtime import env_flag

_EMPTY = inspect.Parameter.empty


def verify_enabled() -> bool:
    return env_flag("MOE_OPS_VERIFY_LAUNCH")


class _Site:
    """One @triton.jit kernel's parameter order and its compiled kernels by caller key."""

    __slots__ = ("kernel", "names", "defaults", "compiled", "tails", "jit_launches",
                 "fast_launches")

    def __init__(self, kernel):
        self.kernel = kernel
        params = inspect.signature(kernel.fn).parameters.values()
        self.names = [p.name for p in params]
        self.defaults = {p.name: p.default for p in params if p.default is not _EMPTY}
        self.compiled: dict = {}
        self.tails: dict = {}   # positional count -> (name, default) of the parameters after
        self.jit_launches = self.fast_launches = 0

    def values(self, args, kwargs) -> list:
        """All parameters in order: the positional ones, then keywords or defaults."""
        tail = self.tails.get(len(args))
        if tail is None:
            tail = self.tails[len(args)] = [(n, self.defaults.get(n, _EMPTY))
                                            for n in self.names[len(args):]]
        values = list(args)
        for name, default in tail:
            v = kwargs.get(name, default)
            if v is _EMPTY:
                raise TypeError(f"{self.kernel.fn.__name__}() missing argument {name!r}")
            values.append(v)
        return values


_sites: dict = {}


class FastLaunch:
    """kernel_for(kernel, device, key)[grid](*args, **kwargs) on CUDA."""

    __slots__ = ("site", "key")

    def __init__(self, kernel, key):
        site = _sites.get(kernel)
        if site is None:
            site = _sites[kernel] = _Site(kernel)
        self.site = site
        self.key = key

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args, kwargs):
        site = self.site
        device = current_device()
        key = (device, self.key)
        ck = site.compiled.get(key)
        if ck is None:
            site.jit_launches += 1
            ck = site.kernel[grid](*args, **kwargs)
            if ck is not None and not hasattr(ck, "result"):   # (not an async compile future)
                if len(site.compiled) >= MAX_KEYS:   # e.g. prefill at ever new token counts
                    site.compiled.clear()
                site.compiled[key] = ck
            return
        if verify_enabled():
            jit = site.kernel.run(*args, grid=grid, warmup=True, **kwargs)
            if jit is not ck:
                raise RuntimeError(
                    f"moe_ops fast launch of {site.kernel.fn.__name__}: key {self.key!r} maps to a "
                    "kernel Triton's JIT would not pick for these arguments (the launcher's key "
                    "misses something the specialisation depends on)")
        site.fast_launches += 1
        values = site.values(args, kwargs)
        stream = current_stream(device)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        hooks = _knobs().runtime
        enter = hooks.launch_enter_hook
        meta = None if enter is None else ck.launch_metadata(grid, stream, *values)
        ck.run(grid[0], g1, g2, stream, ck.function, ck.packed_metadata, meta, enter,
               hooks.launch_exit_hook, *values)


MAX_KEYS = 4096   # compiled kernels remembered per kernel (then forgotten, all at once)


def current_device():
    """The device Triton's JIT launches on (the current CUDA device)."""
    from triton.runtime import driver

    return driver.active.get_current_device()


def current_stream(device):
    from triton.runtime import driver

    return driver.active.get_current_stream(device)


def _knobs():
    from triton import knobs

    return knobs


def tensor_key(t) -> tuple:
    """What Triton's specialisation of a launch can depend on in a tensor the caller was given
    (and every integer the launchers derive from it): dtype, shape, strides, 16-byte alignment."""
    return (t.dtype, t.shape, t.stride(), t.data_ptr() % 16)


def launch_key(base, *tensors):
    """A launch's key: the call's `base` key (None: no fast path) and the 16-byte alignment of
    the buffers the launcher allocated itself (always aligned from PyTorch's CUDA caching
    allocator, but a pluggable allocator may differ)."""
    if base is None:
        return None
    return base, tuple(t.data_ptr() % 16 for t in tensors if t is not None)


def stats() -> dict:
    """{kernel name: (launches through Triton's JIT, fast launches, keys held)} so far."""
    return {site.kernel.fn.__name__: (site.jit_launches, site.fast_launches, len(site.compiled))
            for site in _sites.values()}
