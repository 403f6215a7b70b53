"""Defining ops in the `moe` namespace so that the Python package works whether or not the C++
stub library (csrc_stubs/) defined the schemas first."""
from __future__ import annotations

import torch
from torch.autograd import forward_ad as _forward_ad

from moe_ops._compat import forward_ad_level, functorch_active, has_schema

LIB = torch.library.Library("moe", "FRAGMENT")


def op_defined(name: str) -> bool:
    return has_schema(f"moe::{name}")


def define(schema: str, tags=()) -> str:
    """Defines `moe::<schema>` unless it already exists (e.g. from csrc_stubs); returns the
    qualified name."""
    name = schema.split("(", 1)[0]
    if not op_defined(name):
        LIB.define(schema, tags=tags)
    return f"moe::{name}"


def reject_forward_ad(op: str, *tensors) -> None:
    """Forward-mode AD (torch.autograd.forward_ad dual tensors, as torch.autograd.functional.jvp
    uses) is not implemented by the ops: raise rather than return an output without a tangent,
    which forward AD reads as a zero derivative. Costs a global read per call outside a
    `dual_level` (torch.func.jvp raises on its own: the Functions have no setup_context)."""
    if forward_ad_level() < 0:
        return
    for t in tensors:
        if _forward_ad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(
                f"{op}: forward-mode AD (dual tensors, torch.autograd.forward_ad / "
                "torch.autograd.functional.jvp) is not implemented; use reverse mode "
                "(backward / torch.autograd.grad)")


def reject_functorch(op: str) -> None:
    """torch.func's reverse-mode transforms (grad, vjp, jacrev, hessian) run an
    autograd.Function only through its setup_context, which the ops' Functions do not have
    (their forward saves an intermediate, moe.dispatch's z): say so in the op's terms instead
    of torch's "must override the setup_context staticmethod". Called only when a gradient is
    needed (vmap alone runs the op through torch's batching fallback)."""
    if functorch_active():
        raise NotImplementedError(
            f"{op}: torch.func transforms of its gradient (torch.func.grad, vjp, jacrev, "
            "hessian) are not implemented; use torch.autograd (loss.backward(), "
            "torch.autograd.grad), with torch.func.functional_call for a functional call")
