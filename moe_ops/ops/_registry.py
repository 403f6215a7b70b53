"""Defining ops in the `moe` namespace so that the Python package works whether or not the C++
stub library (csrc_stubs/) defined the schemas first."""
from __future__ import annotations

import torch

_lib = torch.library.Library("moe", "FRAGMENT")


def op_defined(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"moe::{name}", "")
        return True
    except RuntimeError:
        return False


def define(schema: str, tags=()) -> str:
    """Defines `moe::<schema>` unless it already exists (e.g. from csrc_stubs); returns the
    qualified name."""
    name = schema.split("(", 1)[0]
    if not op_defined(name):
        _lib.define(schema, tags=tags)
    return f"moe::{name}"
