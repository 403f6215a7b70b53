from moe_ops.tuning.heuristics import DispatchConfig, dispatch_config

__all__ = ["DispatchConfig", "dispatch_config"]
