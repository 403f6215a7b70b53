"""moe_ops.launch.dispatch on CPU through the Triton interpreter: the forward's paths (TMA weight
tiles, direct rows, half-height tails, the folded and last-program combines at T = 1, dropped
ids) against float64 and against each other."""
import os  # noqa: F401

import pytest
import torch
import torch.nn.functional as F  # noqa: F401
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401

import moe_ops  # noqa: F401
from conftest import (RTOL, OpCounter, assert_equal_across_tile_heights, ds_scale,  # noqa: F401
                      expert_counts_skewed, grad_errors, needs_interpreter, rel_err,
                      spy_kernel_launches)
from training_utils import *  # noqa: F401,F403
from training_utils import _default_mode, _inputs, _poison_empty, _z_err, _double  # noqa: F401
from training_utils import _dense_float64, _oracle_grads, _train_step, _assert_exact_zeros  # noqa: F401
from training_utils import _interpreted_int  # noqa: F401
from training_utils import _check_grads  # noqa: F401
from moe_ops.ops.samples import dispatch_samples, make_dispatch_inputs  # noqa: F401
from moe_ops.reference.dispatch import dispatch_backward_reference, dispatch_z_reference  # noqa: F401,E501


@needs_interpreter
@pytest.mark.parametrize("T", [1, 13])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_dispatch_train_z_zero_for_slots_without_an_expert(interpreter, monkeypatch, T, ids_dtype):
    """moe.dispatch_train's z on the Triton path: rows of ids < 0 and >= E are zero (as the
    reference's), not what the allocator left there (gate_up never writes them), so the op is
    bitwise reproducible and passes opcheck with dropped slots; other rows match the float64
    reference. NaN-filled allocations make an unwritten row show; ids in a strided view."""
    seed = fresh_seed()
    H, I, E, K = 24, 13, 5, 3
    args, g = _inputs(T, H, I, E, K, routing="uniform", seed=seed, ids_dtype=ids_dtype)
    h, w13, w2, w, ids = args
    wide = torch.full((T, 2 * K), 7, dtype=ids_dtype)
    wide[:, ::2] = ids
    ids = wide[:, ::2]                       # non-contiguous ids
    ids[0, 1] = -1
    ids[-1, 0] = E if T > 1 else -(2 ** 31 if ids_dtype == torch.int32 else 2 ** 40)
    if T > 1:
        ids[T // 2, 2] = -7
    args = (h, w13, w2, w, ids)
    _poison_empty(monkeypatch)
    z1 = torch.ops.moe.dispatch_train(*args)[1]
    z2 = torch.ops.moe.dispatch_train(*args)[1]
    assert torch.equal(z1, z2), seed
    flat = ids.reshape(-1)
    dropped = (flat < 0) | (flat >= E)
    assert dropped.sum() >= 2
    assert torch.equal(z1[dropped], torch.zeros_like(z1[dropped])), seed
    ref = dispatch_z_reference(*_double(args[:2]), ids)
    assert rel_err(z1[~dropped], ref[~dropped]) <= 1e-5, seed
    torch.library.opcheck(torch.ops.moe.dispatch_train.default, args)


@needs_interpreter
@pytest.mark.parametrize("pair,a_tma", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("H,I", [(32, 48), (64, 32), (17, 11), (64, 11)])
def test_tma_weight_tiles(interpreter, monkeypatch, H, I, pair, a_tma):
    """DispatchConfig.tma_weights (weight tiles through tensor descriptors, zero-
    filled past the edges; gate tiles past I read up rows that are never stored),
    DispatchConfig.tma_pair (gate and up tiles in one copy of a [E, 2, I, H] view, each
    zero-filled past I) and tma_a (the row GEMMs' A tiles, unmasked: NaN-poisoned padding rows
    must not reach a stored row) match float64 in the forward (output and saved z) and the
    backward; H=17 and I=11 have rows TMA cannot address and fall back."""
    import dataclasses

    from moe_ops.launch._common import weight_desc
    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.launch.dispatch_backward import dispatch_backward_triton
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    seed = fresh_seed()
    T, E, K = 21, 3, 2
    args, g = _inputs(T, H, I, E, K, routing="mixed", seed=seed)
    assert (weight_desc(args[1], [1, 16, 16]) is None) == (H % 4 != 0)
    go = torch.randn(T, H, generator=g)
    cfg = dataclasses.replace(dispatch_config(T, E, K, H, I, "cpu", torch.float32), tma_weights=True,
                              tma_gate_up_pair=pair, tma_down_activations=a_tma)
    bc = with_row_gemms(backward_config(cfg, "cpu", torch.float32), tma_activations=a_tma)
    _poison_empty(monkeypatch)
    out, z = dispatch_triton(*args, config=cfg, save_z=True)
    assert rel_err(out, _dense_float64(*_double(args))) <= 1e-5, seed
    assert _z_err(z, args) <= 1e-5, seed
    got = dispatch_backward_triton(go, *args, z=z, config=cfg, bwd_config=bc)
    ref = dispatch_backward_reference(go.double(), *_double(args))
    for name, err in zip(NAMES, grad_errors(got, ref, go, args)):
        assert err <= 1e-5, (seed, name, err)


@needs_interpreter
@pytest.mark.parametrize("routing", ["uniform", "negative"])
@pytest.mark.parametrize("K", [1, 2, 4])
def test_direct_rows_one_token(interpreter, monkeypatch, routing, K):
    """DispatchConfig.direct_rows (slot s is row block s, no alignment launch): output and saved z
    match float64 with NaN-poisoned scratch, ids < 0 included; at T = 1 (K distinct experts)
    and at T = 3 (slots sharing experts: 3*K slots over 5 experts)."""
    import dataclasses

    import moe_ops.launch.dispatch as launch
    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.tuning.heuristics import dispatch_config

    seed = fresh_seed()
    for T in (1, 3):
        args, g = _inputs(T, 24, 40, 5, K, routing=routing, seed=seed)
        cfg = dataclasses.replace(dispatch_config(T, 5, K, 24, 40, "cpu", torch.float32),
                                  direct_rows=True)
        _poison_empty(monkeypatch)
        monkeypatch.setattr(launch, "align_triton", None)   # the direct path never aligns
        out, z = dispatch_triton(*args, config=cfg, save_z=True)
        assert rel_err(out, _dense_float64(*_double(args))) <= 1e-5, (seed, T)
        assert _z_err(z, args) <= 1e-5, (seed, T)
        monkeypatch.undo()
    # non-contiguous ids at T > 1 take the aligned path (same result)
    args, g = _inputs(3, 24, 40, 5, K, routing=routing, seed=seed)
    ids_t = args[4].t().contiguous().t()
    assert not ids_t.is_contiguous() or K == 1
    args = (*args[:4], ids_t)
    cfg = dataclasses.replace(dispatch_config(3, 5, K, 24, 40, "cpu", torch.float32), direct_rows=True)
    out = dispatch_triton(*args, config=cfg)
    assert rel_err(out, _dense_float64(*_double(args))) <= 1e-5, seed


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_half_tail_tiles(interpreter, monkeypatch, dtype):
    """DispatchConfig.half_height_tails: a row block whose valid rows all fit its first half runs a
    half-height tile. Counts per expert chosen so that both kinds of block occur: 40 rows (a full
    block of 32, then a tail of 8: half), 20 (one block, more than half: full), 16 (exactly half:
    half), 0, and ids < 0. Output, saved z and the backward (recompute mode: gate_up again, and
    the dA and dx GEMMs with BackwardConfig.half_tail) match float64 and the full-tile path
    (bitwise where numpy's products allow it: conftest.numpy_matmul_rows_stable), with
    NaN-poisoned scratch; also with the row GEMMs' A tiles through descriptors
    (tma_a: half-height tiles take a half-height descriptor; padding rows read unmasked)."""
    import dataclasses

    from moe_ops.launch.alignment import align_triton
    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.launch.dispatch_backward import dispatch_backward_triton
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    T, H, I, E, K = 40, 24, 40, 5, 2
    args, _ = _inputs(T, H, I, E, K, routing="uniform", seed=seed, dtype=dtype)
    counts = {0: 40, 1: 20, 2: 16, 4: 3}   # expert 3 empty, 1 slot dropped
    flat = torch.cat([torch.full((n,), e) for e, n in counts.items()] + [torch.tensor([-1])])
    ids = flat[torch.randperm(T * K, generator=g)].view(T, K).to(torch.int32)
    args = (*args[:4], ids)
    base = dataclasses.replace(dispatch_config(T, E, K, H, I, "cpu", dtype), block_m=32)
    al = align_triton(ids, E, 32)
    sorted_slots = al.sorted_slots[: int(al.num_rows)].view(-1, 32)
    half = (sorted_slots[:, 16] >= T * K).tolist()
    assert True in half and False in half, half
    go = torch.randn(T, H, generator=g).to(dtype)
    outs = {}
    for ht in (False, True, "tma_a"):
        cfg = dataclasses.replace(base, half_height_tails=bool(ht), tma_down_activations=ht == "tma_a")
        _poison_empty(monkeypatch)
        out, z = dispatch_triton(*args, config=cfg, save_z=True)
        bc = with_row_gemms(backward_config(cfg, "cpu", dtype),
                            tma_activations=cfg.tma_down_activations)
        grads = dispatch_backward_triton(go, *args, z=None, config=cfg, bwd_config=bc)
        monkeypatch.undo()
        outs[ht] = (out, z, grads)
        tol = RTOL[dtype]
        assert rel_err(out, _dense_float64(*_double(args))) <= tol, (seed, ht)
        assert _z_err(z, args) <= tol, (seed, ht)
        ref = dispatch_backward_reference(go.double(), *_double(args))
        for name, err in zip(NAMES, grad_errors(grads, ref, go, args)):
            assert err <= GRAD_TOL[dtype], (seed, ht, name, err)
    for ht in (True, "tma_a"):
        assert_equal_across_tile_heights(outs[ht][0], outs[False][0], (seed, ht), dtype)
        for a, b in zip(outs[ht][2], outs[False][2]):
            assert_equal_across_tile_heights(a, b, (seed, ht), dtype)




@needs_interpreter
def test_half_tail_decides_on_the_middle_row(interpreter, monkeypatch):
    """half_tail's test reads row block_m/2 of a block: the half-height tile runs exactly where
    a block's valid rows fit its first half. Tail blocks of 17 valid rows of 32 (experts 0 and
    1; the latter after a full block) run the full tile (a test on a later row would run the
    half tile and drop row 16: its slot's output, z and dA/dx rows); 16 (expert 3) runs the
    half tile. The tile heights are recorded per row block in every gate+up and down-kernel
    launch (interpreter: the kernels' block functions are looked up at call time), forward and
    backward (recompute: the gate+up GEMM again); NaN-poisoned scratch."""
    import dataclasses

    import moe_ops.kernels.expert_gemm as kg
    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.launch.dispatch_backward import dispatch_backward_triton
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    T, H, I, E, K = 42, 16, 16, 4, 2
    args, _ = _inputs(T, H, I, E, K, routing="uniform", seed=seed)
    counts = {0: 17, 1: 49, 3: 16, -1: 2}   # expert 2 empty, 2 slots dropped
    flat = torch.cat([torch.full((n,), e) for e, n in counts.items()])
    ids = flat[torch.randperm(T * K, generator=g)].view(T, K).to(torch.int32)
    args = (*args[:4], ids)
    cfg = dataclasses.replace(dispatch_config(T, E, K, H, I, "cpu", torch.float32), block_m=32,
                              half_height_tails=True, direct_rows=False)
    bc = backward_config(cfg, "cpu", torch.float32)
    heights = {"gate_up_block": set(), "down_block": set()}
    # (TILE_M's position: before the variant and w3 arguments, 19 in gate_up_block, 13 in
    # down_block)
    for name, pid_arg, tile_arg in (("gate_up_block", 5, -20), ("down_block", 6, -14)):
        def block(*a, _run=getattr(kg, name), _seen=heights[name], _pid=pid_arg, _tile=tile_arg):
            pid_m = a[_pid]
            _seen.add((_interpreted_int(pid_m), int(a[_tile])))
            return _run(*a)
        monkeypatch.setattr(kg, name, block)
    go = torch.randn(T, H, generator=g)
    _poison_empty(monkeypatch)
    out, z = dispatch_triton(*args, config=cfg, save_z=True)
    grads = dispatch_backward_triton(go, *args, z=None, config=cfg, bwd_config=bc)
    monkeypatch.undo()
    expected = {(0, 32), (1, 32), (2, 32), (3, 16)}   # blocks: e0 17, e1 32 and 17, e3 16
    # (the backward's dA and dx GEMMs run full tiles: block 3 at 32 rows there)
    assert heights == {"gate_up_block": expected, "down_block": expected | {(3, 32)}}, (
        seed, heights)
    assert rel_err(out, _dense_float64(*_double(args))) <= RTOL[torch.float32], seed
    assert _z_err(z, args) <= RTOL[torch.float32], seed
    ref = dispatch_backward_reference(go.double(), *_double(args))
    for name, err in zip(NAMES, grad_errors(grads, ref, go, args)):
        assert err <= GRAD_TOL[torch.float32], (seed, name, err)


@needs_interpreter
@pytest.mark.parametrize("routing", ["uniform", "negative", "mixed"])
@pytest.mark.parametrize("K,H,block_n", [(1, 24, 16), (2, 70, 32), (8, 33, 16), (5, 16, 16)])
def test_combine_last_one_token(interpreter, monkeypatch, routing, K, H, block_n):
    """DispatchConfig.combine_in_down at T == 1: the last down program of each H tile sums the K
    rows (counters zeroed by gate_up). Bitwise equal to the separate combine kernel and within
    float32 rounding of float64, with NaN-poisoned scratch and outputs, ids < 0 included, H
    tiles 1 to 5; the counters never depend on an earlier call (two calls in a row)."""
    import dataclasses

    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.tuning.heuristics import dispatch_config

    seed = fresh_seed()
    E, I = 9, 37
    args, _ = _inputs(1, H, I, E, K, routing=routing, seed=seed)
    base = dataclasses.replace(dispatch_config(1, E, K, H, I, "cpu", torch.float32), direct_rows=True,
                               down_block_n=block_n)
    ref = _dense_float64(*_double(args))
    got = {}
    for cl in (False, True, True):
        _poison_empty(monkeypatch)
        out = torch.full((1, H), float("nan"))
        dispatch_triton(*args, config=dataclasses.replace(base, combine_in_down=cl), out=out)
        monkeypatch.undo()
        assert rel_err(out, ref) <= 1e-5, (seed, cl)
        if cl in got:
            assert torch.equal(out, got[cl]), seed
        got[cl] = out
    assert torch.equal(got[True], got[False]), seed


@needs_interpreter
@pytest.mark.parametrize("routing", ["uniform", "negative"])
@pytest.mark.parametrize("K,H,I,block_n,block_k,dtype", [   # (dtypes alternate: CI time)
    (1, 24, 40, 16, 32, torch.float32), (2, 17, 11, 16, 16, torch.float16),
    (4, 33, 70, 32, 32, torch.float32), (16, 40, 72, 16, 64, torch.float16),
    (16, 40, 72, 16, 64, torch.float32), (40, 9, 5, 16, 16, torch.float16)])
def test_fused_combine_one_token(interpreter, monkeypatch, routing, K, H, I, block_n, block_k,
                                 dtype):
    """DispatchConfig.down_combine_fused at T == 1 (the down GEMM and the combine in one launch, one
    pipelined loop over (slot, I step)): output and saved z match float64 with NaN-poisoned
    scratch, ids < 0 included, odd H and I, several H tiles and I steps, K = block_m = 16 (every
    accumulator row in use) and K = 40 > block_m (falls back to the separate combine); the
    backward consumes the z it saves. At T > 1 the setting is ignored."""
    import dataclasses

    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.launch.dispatch_backward import dispatch_backward_triton
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    import moe_ops.launch.dispatch as launch

    seed = fresh_seed()
    E = max(5, K)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for T, tma in ((1, False), (1, True), (3, False)):
        args, g = _inputs(T, H, I, E, K, routing=routing, seed=seed, dtype=dtype)
        cfg = dataclasses.replace(dispatch_config(T, E, K, H, I, "cpu", dtype), direct_rows=True,
                                  down_combine_fused=True, down_block_n=block_n, down_block_k=block_k, tma_weights=tma)
        assert cfg.block_m == 16
        _poison_empty(monkeypatch)
        combines = []
        real_combine = launch.combine_triton
        monkeypatch.setattr(launch, "combine_triton",
                            lambda *a, **kw: combines.append(1) or real_combine(*a, **kw))
        out, z = dispatch_triton(*args, config=cfg, save_z=True)
        assert len(combines) == (0 if T == 1 and K <= 16 else 1), (T, K)   # the path taken
        assert not out.isnan().any(), (seed, T)
        assert rel_err(out, _dense_float64(*_double(args))) <= tol, (seed, T)
        assert _z_err(z, args) <= tol, (seed, T)
        if dtype == torch.float32 and K <= 4:
            go = torch.randn(T, H, generator=g)
            got = dispatch_backward_triton(go, *args, z=z, config=cfg,
                                           bwd_config=backward_config(cfg, "cpu", dtype))
            ref = dispatch_backward_reference(go.double(), *_double(args))
            for name, err in zip(NAMES, grad_errors(got, ref, go, args)):
                assert err <= 1e-5, (seed, T, name, err)
        monkeypatch.undo()


@needs_interpreter
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("path", ["fused", "fused tma", "combine last", "combine kernel"])
def test_one_token_unused_expert_weights_never_reach_the_output(interpreter, path, bad):
    """T == 1 on each of its paths, with a dropped id (< 0 and >= E) and non-finite weights
    (w13 and w2) in an expert no slot uses (expert 0, which a dropped id was mapped to for an
    in-bounds read): an id that is dropped contributes nothing, so the output is finite and
    matches float64, and with every id dropped the output row is zeros (the fused kernel once
    multiplied expert 0's tile by zero rows: 0 * NaN = NaN in every accumulator row)."""
    import dataclasses

    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.reference.dispatch import dispatch_reference
    from moe_ops.tuning.heuristics import dispatch_config

    seed = fresh_seed()
    H, I, E, K = 24, 40, 6, 4
    args, _ = _inputs(1, H, I, E, K, routing="uniform", seed=seed)
    h, w13, w2, w, _ = args
    w13, w2 = w13.clone(), w2.clone()
    w13[0].fill_(bad)
    w2[0].fill_(bad)
    cfg = dataclasses.replace(dispatch_config(1, E, K, H, I, "cpu", torch.float32), direct_rows=True,
                              down_combine_fused=path.startswith("fused"), tma_weights="tma" in path,
                              combine_in_down=path == "combine last")
    for ids in ([[3, -1, 5, E]], [[-1, E, -7, E + 3]]):
        ids = torch.tensor(ids, dtype=torch.int32)
        out = dispatch_triton(h, w13, w2, w, ids, config=cfg)
        ref = dispatch_reference(h.double(), w13.double(), w2.double(), w.double(), ids)
        assert ref.isfinite().all()
        assert out.isfinite().all(), (seed, ids)
        assert rel_err(out, ref) <= 1e-5 or torch.equal(out, torch.zeros_like(out)), (seed, ids)
        if (ids < 0).logical_or(ids >= E).all():
            assert torch.equal(out, torch.zeros_like(out)), seed


# int64 ids out of range that wrap to a valid expert when narrowed to int32
WRAPPING_IDS = (-(2**32), -(2**32) + 2, 2**32 + 1, -(2**40) + 1)


@needs_interpreter
def test_int64_ids_wrapping_in_int32_dropped(interpreter, mode):
    """int64 ids < 0 or >= E whose low 32 bits name a valid expert (-2^32 -> 0, 2^32 + 1 -> 1)
    are dropped like -1: the forward and every gradient in both backward modes are bitwise
    those of the same call with -1 there (the alignment kernels once narrowed the ids before
    testing them, so the recompute backward routed such slots to an expert)."""
    seed = fresh_seed()
    T, H, I, E, K = 6, 16, 8, 4, 2
    args, g = _inputs(T, H, I, E, K, routing="uniform", seed=seed, requires_grad=True,
                      ids_dtype=torch.int64)
    ids = args[4].clone()
    for n, v in enumerate(WRAPPING_IDS):
        ids[n, n % K] = v
    dropped = ids.masked_fill((ids < 0) | (ids >= E), -1)
    go = torch.randn(T, H, generator=g)
    out, grads, _ = _train_step(args[:4] + (ids,), go)
    out_ref, grads_ref, _ = _train_step(args[:4] + (dropped,), go)
    assert torch.equal(out, out_ref), seed
    for name, a, b in zip(NAMES, grads, grads_ref):
        assert torch.equal(a, b), (seed, mode, name)


@needs_interpreter
@pytest.mark.parametrize("fused", [False, True])
def test_one_token_int64_wrapping_ids_dropped(interpreter, fused):
    """At T == 1 (direct rows; with and without the folded combine) an int64 id whose low 32
    bits name a valid expert is dropped (the folded down+combine kernel once narrowed first and
    read a never-written activation row)."""
    import dataclasses

    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.tuning.heuristics import dispatch_config

    seed = fresh_seed()
    T, H, I, E, K = 1, 32, 24, 5, 4
    (h, w13, w2, w, ids), _ = _inputs(T, H, I, E, K, routing="uniform", seed=seed,
                                      ids_dtype=torch.int64)
    bad = ids.clone()
    bad[0, 0] = -(2**32) + 1
    bad[0, 2] = 2**32 + 3
    dropped = bad.masked_fill((bad < 0) | (bad >= E), -1)
    cfg = dataclasses.replace(dispatch_config(T, E, K, H, I, "cpu", torch.float32), direct_rows=True,
                              down_combine_fused=fused)
    out = dispatch_triton(h, w13, w2, w, bad, config=cfg)
    assert rel_err(out, _dense_float64(*_double((h, w13, w2, w, dropped)))) <= 1e-5, seed


@needs_interpreter
@pytest.mark.parametrize("fused,tma", [(False, False), (True, False), (True, True)])
def test_one_token_out_of_range_ids_dropped(interpreter, monkeypatch, fused, tma):
    """At T == 1 (direct rows, and the folded combine) an id >= E is dropped like an id < 0:
    no out-of-bounds weight read, the other slots unchanged."""
    import dataclasses

    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.tuning.heuristics import dispatch_config

    seed = fresh_seed()
    T, H, I, E, K = 1, 32, 24, 5, 4
    (h, w13, w2, w, ids), _ = _inputs(T, H, I, E, K, routing="uniform", seed=seed)
    bad = ids.clone()
    bad[0, 1] = E
    bad[0, 3] = 1000
    dropped = bad.masked_fill(bad >= E, -1)
    cfg = dataclasses.replace(dispatch_config(T, E, K, H, I, "cpu", torch.float32), direct_rows=True,
                              down_combine_fused=fused, tma_weights=tma)
    _poison_empty(monkeypatch)
    out = dispatch_triton(h, w13, w2, w, bad, config=cfg)
    assert rel_err(out, _dense_float64(*_double((h, w13, w2, w, dropped)))) <= 1e-5, seed


@needs_interpreter
@pytest.mark.parametrize("T,K,direct", [(64, 4, True), (257, 1, False)])
def test_direct_rows_up_to_max_slots(interpreter, monkeypatch, T, K, direct):
    """DispatchConfig.direct_rows at T > 1: direct rows (no alignment launch) for up to
    DIRECT_MAX_SLOTS (256) slots with contiguous ids; one slot more takes the alignment. Both
    match float64."""
    import dataclasses

    import moe_ops.launch.dispatch as ld
    from moe_ops.tuning.heuristics import dispatch_config

    assert ld.DIRECT_MAX_SLOTS == 256
    seed = fresh_seed()
    H, I, E = 16, 16, 8
    args, _ = _inputs(T, H, I, E, K, routing="mixed", seed=seed)
    aligned = []
    real = ld.align_triton
    monkeypatch.setattr(ld, "align_triton", lambda *a, **kw: aligned.append(a) or real(*a, **kw))
    cfg = dataclasses.replace(dispatch_config(T, E, K, H, I, "cpu", torch.float32), direct_rows=True)
    out = ld.dispatch_triton(*args, config=cfg)
    assert len(aligned) == (0 if direct else 1), (seed, T, K, len(aligned))
    assert rel_err(out, _dense_float64(*_double(args))) <= RTOL[torch.float32], seed
