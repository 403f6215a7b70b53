"""Op definitions: importing this module registers torch.ops.moe.*."""
from moe_ops.ops import dispatch, routing  # noqa: F401
