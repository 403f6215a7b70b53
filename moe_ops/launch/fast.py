"""Launching an already compiled Triton kernel without Triton's per-call argument binding.

A Triton 3.6 launch costs ~33 us of host time on the H200 host for our ~40-parameter GEMM
kernels (docs/design.md, host overhead): the JIT binds every argument, computes its
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

from moe_ops import _env
from moe_ops._compat import current_device, current_stream, jit_pick, launch_hooks, run_compiled

_EMPTY = inspect.Parameter.empty


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

    __slots__ = ("site", "key", "options")

    def __init__(self, kernel, key, options=None):
        site = _sites.get(kernel)
        if site is None:
            site = _sites[kernel] = _Site(kernel)
        self.site = site
        self.key = key
        self.options = options or {}   # compile options under the call's keywords

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args, kwargs):
        site = self.site
        device = current_device()
        key = (device, self.key)
        ck = site.compiled.get(key)
        if ck is None:
            site.jit_launches += 1
            ck = site.kernel[grid](*args, **{**self.options, **kwargs})
            if ck is not None and not hasattr(ck, "result"):   # (not an async compile future)
                if len(site.compiled) >= MAX_KEYS:   # e.g. prefill at ever new token counts
                    site.compiled.clear()
                site.compiled[key] = ck
            return
        if _env.verify_launch():
            jit = jit_pick(site.kernel, grid, args, {**self.options, **kwargs})
            if jit is not ck:
                raise RuntimeError(
                    f"moe_ops fast launch of {site.kernel.fn.__name__}: key {self.key!r} maps to a "
                    "kernel Triton's JIT would not pick for these arguments (the launcher's key "
                    "misses something the specialisation depends on)")
        site.fast_launches += 1
        values = site.values(args, kwargs)
        enter, exit_hook = launch_hooks()
        run_compiled(ck, grid, current_stream(device), values, enter, exit_hook)


MAX_KEYS = 4096   # compiled kernels remembered per kernel (then forgotten, all at once)


def tensor_key(t) -> tuple:
    """What Triton's specialisation of a launch can depend on in a tensor the caller was given
    (and every integer the launchers derive from it): dtype, shape, strides, 16-byte alignment."""
    return (t.dtype, t.shape, t.stride(), t.data_ptr() % 16)


def optional_tensor_key(t) -> tuple | None:
    """tensor_key of an optional tensor argument (None stays None)."""
    return None if t is None else tensor_key(t)


def launch_key(base, *tensors):
    """A launch's key: the call's `base` key (None: no fast path) and the 16-byte alignment of
    the buffers the launcher allocated itself (always aligned from PyTorch's CUDA caching
    allocator, but a pluggable allocator may differ)."""
    if base is None:
        return None
    return base, tuple(t.data_ptr() % 16 for t in tensors if t is not None)
