"""Plain-torch implementations: the CPU kernels of the ops and the tests' float64 oracles."""
from moe_ops.reference.alignment import align_reference
from moe_ops.reference.dispatch import dispatch_backward_reference, dispatch_reference
from moe_ops.reference.routing import route_reference

__all__ = ["align_reference", "dispatch_backward_reference", "dispatch_reference", "route_reference"]
