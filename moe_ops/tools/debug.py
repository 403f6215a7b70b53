"""Debugging aids (not imported by `import moe_ops`)."""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts calls of torch.ops.moe.* that reach the dispatcher below Autograd (forward and
    backward ops alike) while the block runs, by op name: shows which path a model took (e.g.
    whether a transformers patch took effect).

        with OpCounter() as calls:
            model(ids)
        calls.counts   # {"route": 2, "dispatch": 2}
    """

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "moe":
            name = func.__name__.split(".")[0]
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))
