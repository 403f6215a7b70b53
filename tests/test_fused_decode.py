"""DispatchConfig.fuse_down (decode): both expert GEMMs in one kernel with float32 partial down
products per I tile, summed by combine_partials_kernel. Interpreted Triton kernels on the CPU
against a float64 oracle, NaN-poisoned scratch and outputs."""
import dataclasses

import pytest
import torch

from conftest import needs_interpreter, rel_err
from test_dispatch import _dense_float64
from test_training_modes import _double, _inputs, _poison_empty, fresh_seed


def _run(args, cfg, monkeypatch, calls=None):
    import moe_ops.launch.dispatch as launch

    T, H = args[0].shape
    _poison_empty(monkeypatch)
    if calls is not None:
        for name in ("fused_experts_triton", "gate_up_triton", "rows_gemm_triton",
                     "combine_triton", "combine_partials_triton"):
            real = getattr(launch, name)
            monkeypatch.setattr(launch, name, lambda *a, _r=real, _n=name, **kw:
                                calls.append(_n) or _r(*a, **kw))
    out = torch.full((T, H), float("nan"), dtype=args[0].dtype)
    launch.dispatch_triton(*args, config=cfg, out=out)
    monkeypatch.undo()
    return out


@needs_interpreter
@pytest.mark.parametrize("routing", ["uniform", "negative", "mixed", "one_expert"])
@pytest.mark.parametrize("T,K,H,I,E,variant", [
    (T, K, H, I, E, v)
    for T, K, H, I, E in [(1, 4, 33, 40, 6), (1, 8, 24, 70, 9), (3, 2, 40, 37, 5),
                          (9, 3, 17, 48, 4), (20, 2, 32, 16, 3)]
    for v in ["pointer", "tma", "tma pair"] + (["direct"] if T == 1 else [])])
def test_fuse_down_matches_float64(interpreter, monkeypatch, routing, T, K, H, I, E, variant):
    """Odd H and I (partial I tiles and H steps), several I tiles and H steps, ids < 0, one
    expert taking every slot (more rows than one row block: several blocks of one expert),
    direct rows at T == 1, TMA tiles (paired or not) and pointer loads; the path taken is the
    fused one; two calls give bitwise equal outputs."""
    from moe_ops.tuning.heuristics import dispatch_config

    seed = fresh_seed()
    args, _ = _inputs(T, H, I, E, K, routing=routing, seed=seed)
    cfg = dataclasses.replace(dispatch_config(T, E, K, H, I, "cpu", torch.float32),
                              fuse_down=True, block_m=16, block_n1=16, block_k1=16, block_n2=16,
                              tma=variant.startswith("tma"), tma_pair=variant == "tma pair",
                              direct=variant == "direct")
    calls = []
    out = _run(args, cfg, monkeypatch, calls)
    assert calls == ["fused_experts_triton", "combine_partials_triton"], calls
    assert rel_err(out, _dense_float64(*_double(args))) <= 1e-5, (seed, variant)
    assert torch.equal(out, _run(args, cfg, monkeypatch)), seed


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float16])
def test_fuse_down_16bit(interpreter, monkeypatch, dtype):
    """16-bit inputs: the activation is rounded to the input dtype before the down product (as
    the two-kernel path stores it); within the dtype's rounding of float64. (bfloat16 products
    are wrong in Triton's interpreter, ENVIRONMENT.md: the GPU tests cover bfloat16.)"""
    from moe_ops.tuning.heuristics import dispatch_config

    seed = fresh_seed()
    T, K, H, I, E = 5, 4, 48, 40, 7
    args, _ = _inputs(T, H, I, E, K, routing="negative", seed=seed, dtype=dtype)
    cfg = dataclasses.replace(dispatch_config(T, E, K, H, I, "cpu", dtype), fuse_down=True,
                              block_n1=16, block_k1=16, block_n2=32, tma=True, tma_pair=True)
    out = _run(args, cfg, monkeypatch)
    tol = 2e-3
    assert rel_err(out, _dense_float64(*_double(args))) <= tol, seed


@needs_interpreter
def test_fuse_down_not_for_training(interpreter, monkeypatch):
    """A training forward (save_z) takes the two-kernel path, which saves z."""
    import moe_ops.launch.dispatch as launch
    from moe_ops.tuning.heuristics import dispatch_config

    seed = fresh_seed()
    T, K, H, I, E = 2, 2, 16, 16, 3
    args, _ = _inputs(T, H, I, E, K, routing="uniform", seed=seed)
    cfg = dataclasses.replace(dispatch_config(T, E, K, H, I, "cpu", torch.float32),
                              fuse_down=True)
    _poison_empty(monkeypatch)
    out, z = launch.dispatch_triton(*args, config=cfg, save_z=True)
    monkeypatch.undo()
    assert z.shape == (T * K, 2 * I) and not z.isnan().any()
    assert rel_err(out, _dense_float64(*_double(args))) <= 1e-5, seed
