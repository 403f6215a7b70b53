"""Every environment variable moe_ops reads, in one place. Nothing else in the package reads
os.environ. Values are read at call time (not at import), so tests and users can change them
between calls.

| variable | type | default | effect |
|---|---|---|---|
| TRITON_INTERPRET | flag | off | CPU tensors run the Triton kernels through Triton's interpreter instead of the PyTorch reference (Triton's own variable, read the way Triton reads it) |
| MOE_OPS_CHECK | flag | off | data-dependent argument checks in eager mode (ids >= E raise ValueError); costs a host sync per call |
| MOE_OPS_RECOMPUTE | flag | off | training memory mode of moe.dispatch: the backward recomputes the gate+up product instead of saving it (moe_ops.set_recompute overrides it) |
| MOE_OPS_FAST_LAUNCH | flag | on | CUDA launches after the first with the same arguments' layout skip Triton's per-call argument binding (moe_ops.launch.fast) |
| MOE_OPS_VERIFY_LAUNCH | flag | off | every fast launch also asks Triton's JIT which kernel it would run and raises if that is another one (the GPU tests turn it on) |
| MOE_OPS_TUNING_DIR | path | unset | directory of tuned config tables: written by moe-ops-tune, and the only place looked up when set |
| XDG_CACHE_HOME | path | ~/.cache | parent of the default tuned-table directory (moe_ops/tuning under it) |
| MOE_OPS_COMMIT | str | unset | commit recorded by moe-ops-bench where the tree has no .git (a copied checkout) |

Flags are on for 1 / true / yes / on / y (any case), off for anything else; unset gives the
default."""
from __future__ import annotations

import os

_TRUE_WORDS = ("1", "true", "yes", "on", "y")

# name -> (kind, default, one-line description): the table above, for tools that list them
VARIABLES = {
    "TRITON_INTERPRET": ("flag", False, "CPU tensors run the Triton kernels interpreted"),
    "MOE_OPS_CHECK": ("flag", False, "data-dependent checks (ids < E); one host sync per call"),
    "MOE_OPS_RECOMPUTE": ("flag", False, "backward recomputes the gate+up product (less memory)"),
    "MOE_OPS_FAST_LAUNCH": ("flag", True, "skip Triton's per-call argument binding on CUDA"),
    "MOE_OPS_VERIFY_LAUNCH": ("flag", False, "check every fast launch against Triton's JIT"),
    "MOE_OPS_TUNING_DIR": ("path", None, "directory of tuned config tables"),
    "XDG_CACHE_HOME": ("path", None, "parent of the default tuned-table directory"),
    "MOE_OPS_COMMIT": ("str", None, "commit recorded by moe-ops-bench without .git"),
}


def _flag(name: str) -> bool:
    value = os.environ.get(name)
    if value is None:
        return VARIABLES[name][1]
    return value.strip().lower() in _TRUE_WORDS


def _value(name: str) -> str | None:
    return os.environ.get(name) or None


def interpret() -> bool:
    return _flag("TRITON_INTERPRET")


def check() -> bool:
    return _flag("MOE_OPS_CHECK")


def recompute() -> bool:
    return _flag("MOE_OPS_RECOMPUTE")


def fast_launch() -> bool:
    return _flag("MOE_OPS_FAST_LAUNCH")


def verify_launch() -> bool:
    return _flag("MOE_OPS_VERIFY_LAUNCH")


def tuning_dir() -> str | None:
    return _value("MOE_OPS_TUNING_DIR")


def xdg_cache_home() -> str | None:
    return _value("XDG_CACHE_HOME")


def commit() -> str | None:
    return _value("MOE_OPS_COMMIT")


def child_env(**overrides: str) -> dict:
    """This process's environment with `overrides`, for a child process."""
    return dict(os.environ, **overrides)
