"""moe_ops.tuning.configs: keyword-only config dataclasses and the one constraint API through
which experiments change them."""
import dataclasses

import pytest
import torch

from moe_ops.tuning import (AlignmentConfig, BackwardConfig, DispatchConfig, WeightGradConfig,
                            backward_config, config_constraints, dispatch_config,
                            reset_config_constraints, update_config_constraints)


def test_configs_are_keyword_only():
    with pytest.raises(TypeError):
        DispatchConfig(16, 32, 32, 32, 32, 4, 1)
    cfg = DispatchConfig(block_m=16, gate_up_block_n=32, gate_up_block_k=32, down_block_n=32,
                         down_block_k=32, num_warps=4, num_stages=1)
    assert not cfg.direct_rows and cfg.group_m == 8


def test_constraints_apply_to_heuristic_configs_and_nested_ones():
    shape = (8192, 128, 8, 2048, 768)
    base = dispatch_config(*shape, "cpu", torch.float32)
    bbase = backward_config(base, "cpu", torch.float32)
    try:
        update_config_constraints(DispatchConfig, num_stages=2)
        update_config_constraints(WeightGradConfig, block_k=8)
        assert dispatch_config(*shape, "cpu", torch.float32) == dataclasses.replace(
            base, num_stages=2)
        got = backward_config(base, "cpu", torch.float32)
        assert isinstance(got, BackwardConfig) and got.weight_grad.block_k == 8
        assert got.input_grad_gemm == bbase.input_grad_gemm
    finally:
        reset_config_constraints()
    assert dispatch_config(*shape, "cpu", torch.float32) == base
    assert backward_config(base, "cpu", torch.float32) == bbase


def test_constraints_context_restores_previous():
    from moe_ops.launch.alignment import alignment_config

    assert alignment_config() == AlignmentConfig()
    with config_constraints(AlignmentConfig, triangular_rank=False):
        assert not alignment_config().triangular_rank
        with config_constraints(AlignmentConfig, scan_warps=8):
            assert alignment_config().scan_warps == 8 and not alignment_config().triangular_rank
        assert alignment_config().scan_warps == 4 and not alignment_config().triangular_rank
    assert alignment_config() == AlignmentConfig()


def test_bad_constraints_name_the_field():
    with pytest.raises(ValueError, match="no field.*'wg_m'"):
        update_config_constraints(WeightGradConfig, wg_m=64)
    with pytest.raises(TypeError, match="not a moe_ops config class"):
        update_config_constraints(dict, x=1)
