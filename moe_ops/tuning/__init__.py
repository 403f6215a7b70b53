"""Kernel configurations from shapes: config dataclasses and their constraints (configs),
heuristics (pure: shape + device -> config) and tuned tables (JSON per device)."""
from moe_ops.tuning.configs import (ActivationGradConfig, AlignmentConfig, BackwardConfig,
                                    DispatchConfig, QuantDispatchConfig, RowGemmConfig,
                                    WeightGradConfig, config_constraints,
                                    reset_config_constraints, update_config_constraints)
from moe_ops.tuning.heuristics import backward_config, dispatch_config, quant_dispatch_config

__all__ = ["ActivationGradConfig", "AlignmentConfig", "BackwardConfig", "DispatchConfig",
           "QuantDispatchConfig", "RowGemmConfig", "WeightGradConfig", "backward_config",
           "config_constraints", "dispatch_config", "quant_dispatch_config",
           "reset_config_constraints", "update_config_constraints"]
