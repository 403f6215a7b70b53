"""moe_ops.launch.dispatch_backward on CPU through the Triton interpreter: several tiles, the
saved z's dropped rows, the persistent weight gradients and their LPT schedule, the trimmed
sums."""
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


# ---------------------------------------------------------------------------------------------
# the Triton backward's launcher directly


@needs_interpreter
@pytest.mark.parametrize("saved", [True, False])
def test_backward_launcher_several_tiles(interpreter, monkeypatch, saved):
    """dispatch_backward_triton (dA GEMM + elementwise SwiGLU-gradient pass, weight gradients,
    dx) matches float64 over several row blocks and I chunks, with NaN-poisoned scratch."""
    from moe_ops.launch.dispatch import dispatch_triton
    from moe_ops.launch.dispatch_backward import dispatch_backward_triton
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    seed = fresh_seed()
    T, H, I, E, K = 21, 40, 37, 3, 2
    args, g = _inputs(T, H, I, E, K, routing="mixed", seed=seed)
    go = torch.randn(T, H, generator=g)
    cfg = dispatch_config(T, E, K, H, I, "cpu", torch.float32)
    bc = backward_config(cfg, "cpu", torch.float32)
    _, z = dispatch_triton(*args, save_z=True)
    _poison_empty(monkeypatch)
    got = dispatch_backward_triton(go, *args, z=z if saved else None, config=cfg, bwd_config=bc)
    ref = dispatch_backward_reference(go.double(), *_double(args))
    for name, a, err in zip(NAMES, got, grad_errors(got, ref, go, args)):
        assert not a.isnan().any(), (seed, name)
        assert err <= 1e-5, (seed, name, err)


# ---------------------------------------------------------------------------------------------
# the persistent weight-gradient kernels (interpreted) against the per-tile kernel


# The per-tile kernel's configuration and the persistent kernel's (the heuristic's 32-row
# tiles), with several bookkeeping chunks per program and with the LPT schedule.
PERSISTENT_WG = {
    "persistent": ("_weight_grad_persistent", dict(persistent=False), dict(persistent=True)),
    # several bookkeeping chunks per program
    "small chunks": ("_weight_grad_persistent", dict(persistent=False),
                     dict(persistent=True, persistent_chunk=4)),
    # largest experts first, snaking rounds; with 2-tile chunks, several chunks per program
    "lpt": ("_weight_grad_persistent", dict(persistent=False),
            dict(persistent=True, lpt_schedule=True, persistent_chunk=2)),
}


@needs_interpreter
@pytest.mark.parametrize("kernel", list(PERSISTENT_WG))
@pytest.mark.parametrize("routing", ["uniform", "mixed", "one_expert", "skewed"])
def test_persistent_weight_grads_match_per_tile(interpreter, routing, kernel):
    """Three programs of a persistent weight-gradient kernel (plain, or warp-specialised: the
    same arithmetic in the interpreter, no warp groups) walk all output tiles of both weight
    gradients (several tiles per expert, several experts per program, an empty expert where the
    routing leaves one): bitwise the per-tile kernel's sums (same rows, same order, same tile),
    and near float64. (The warp-specialised launcher's fallbacks: the next test.)"""

    import moe_ops.launch.dispatch_backward as db
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    launcher, per_tile_fields, fields = PERSISTENT_WG[kernel]
    seed = fresh_seed()
    T, H, I, E, K = 24, 48, 40, 5, 2
    args, g = _inputs(T, H, I, E, K, routing=routing, seed=seed, dtype=torch.float16)
    go = torch.randn(T, H, generator=g).to(torch.float16)
    cfg = dispatch_config(T, E, K, H, I, "cpu", torch.float16)
    bc = backward_config(cfg, "cpu", torch.float16)
    calls = []
    run = getattr(db, launcher)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(db, launcher, lambda *a: (calls.append(a[2].shape), run(*a))[1])
        per_tile = db.dispatch_backward_triton(
            go, *args, config=cfg, bwd_config=with_weight_grad(bc, **per_tile_fields))
        assert calls == []
        persistent = db.dispatch_backward_triton(
            go, *args, config=cfg, bwd_config=with_weight_grad(bc, **fields))
    assert calls == [(E, H, I), (E, 2 * I, H)], (seed, calls)   # dW2, then dW13
    ref = dispatch_backward_reference(go.double(), *_double(args))
    errs = grad_errors(persistent, ref, go, args)
    for name, a, b, r, err in zip(NAMES, persistent, per_tile, ref, errs):
        assert torch.equal(a, b), (seed, name)
        if r.norm() == 0:
            assert torch.equal(a, torch.zeros_like(a)), (seed, name)
        else:
            assert err <= GRAD_TOL[torch.float16], (seed, name, err)


@needs_interpreter
@pytest.mark.parametrize("routing", ["skewed", "one_expert", "empty_experts", "negative",
                                     "balanced"])
def test_persistent_weight_grads_lpt_order(interpreter, routing, monkeypatch):
    """The LPT schedule's expert order, as each program computes it: where the largest expert
    has more than twice the mean rows, experts by valid rows, largest first, ties by expert
    index (empty experts last); else the experts' own order; in every program's row of the
    scratch. The gradients are bitwise those of the fixed schedule (each tile is still summed
    whole, in row order, by one program)."""

    import moe_ops.launch.dispatch_backward as db
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    seed = fresh_seed()
    T, H, I, E, K = 40, 32, 24, 12, 3
    args, g = _inputs(T, H, I, E, K, routing="uniform" if routing == "balanced" else routing,
                      seed=seed, dtype=torch.float16)
    if routing == "balanced":   # every expert 10 rows: the experts' own order
        args = (*args[:4], (torch.arange(T * K) % E).reshape(T, K).to(args[4].dtype))
    go = torch.randn(T, H, generator=g).to(torch.float16)
    cfg = dispatch_config(T, E, K, H, I, "cpu", torch.float16)
    bc = with_weight_grad(backward_config(cfg, "cpu", torch.float16), persistent=True,
                          persistent_chunk=2)
    orders = []

    def record(kernel, grid, args, kwargs):
        if kwargs.get("LPT"):
            orders.append(kwargs["order_ptr"].clone())

    spy_kernel_launches(monkeypatch, db, record)
    fixed = db.dispatch_backward_triton(go, *args, config=cfg, bwd_config=bc)
    assert orders == []
    lpt = db.dispatch_backward_triton(go, *args, config=cfg,
                                      bwd_config=with_weight_grad(bc, lpt_schedule=True))
    assert len(orders) == 2, (seed, len(orders))   # dW2, dW13
    counts, skewed = expert_counts_skewed(args[4], E, db.LPT_MIN_SKEW)
    if routing in ("skewed", "one_expert"):
        assert skewed, (seed, counts)   # both branches of the kernel's test are covered
    if routing == "balanced":
        assert not skewed, (seed, counts)
    expected = sorted(range(E), key=lambda e: (-counts[e], e)) if skewed else list(range(E))
    for order in orders:
        assert order.shape == (3, 16), order.shape   # 3 interpreted programs, BLOCK_E = 16
        for row in order:
            assert row[:E].tolist() == expected, (seed, routing, row.tolist(), counts)
    for name, a, b in zip(NAMES, lpt, fixed):
        assert torch.equal(a, b), (seed, name)


@needs_interpreter
def test_persistent_weight_grads_many_experts(interpreter, monkeypatch):
    """More experts (1100) than the persistent kernel once allowed (one vector lane per expert,
    at most 1024): the chunked kernel has no expert limit, runs, and is bitwise the per-tile
    kernel's on NaN-poisoned scratch, most experts empty. (The per-tile kernel runs on the
    experts hit alone, renumbered in order: each expert's rows, their order and their place in
    a tile are the same, so are its sums; interpreting 1100 per-tile programs took ~45 s.)"""

    import moe_ops.launch.dispatch_backward as db
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    seed = fresh_seed()
    T, H, I, E, K = 6, 16, 16, 1100, 2
    args, g = _inputs(T, H, I, E, K, routing="uniform", seed=seed, dtype=torch.float16)
    h, w13, w2, w, ids = args
    go = torch.randn(T, H, generator=g).to(torch.float16)
    cfg = dispatch_config(T, E, K, H, I, "cpu", torch.float16)
    bc = backward_config(cfg, "cpu", torch.float16)
    hit = torch.unique(ids[ids >= 0])
    assert 1 <= len(hit) < E // 2, (seed, hit)
    renumber = torch.full((E,), -1, dtype=ids.dtype)
    renumber[hit] = torch.arange(len(hit), dtype=ids.dtype)
    ids_hit = torch.where(ids >= 0, renumber[ids.clamp_min(0).long()], ids)
    calls = []
    run = db._weight_grad_persistent
    monkeypatch.setattr(db, "_weight_grad_persistent",
                        lambda *a: (calls.append(a[2].shape), run(*a))[1])
    _poison_empty(monkeypatch)
    per_tile = db.dispatch_backward_triton(go, h, w13[hit], w2[hit], w, ids_hit, config=cfg,
                                           bwd_config=bc)
    persistent = db.dispatch_backward_triton(
        go, *args, config=cfg, bwd_config=with_weight_grad(bc, persistent=True))
    assert calls == [(E, H, I), (E, 2 * I, H)], (seed, calls)
    missed = torch.ones(E, dtype=torch.bool)
    missed[hit] = False
    for name, a, b in zip(NAMES, persistent, per_tile):
        if name in ("w13", "w2"):
            assert torch.equal(a[missed], torch.zeros_like(a[missed])), (seed, name)
            a = a[hit]
        assert torch.equal(a, b), (seed, name)
    assert persistent[1][hit].abs().sum() > 0, seed   # the experts hit


@needs_interpreter
@pytest.mark.parametrize("field,value", [("persistent_chunk", 3), ("persistent_chunk", 64),
                                         ("persistent_chunk", 0)])
def test_persistent_weight_grads_bad_config(interpreter, field, value):
    """A persistent weight-gradient config the kernel cannot run is a ValueError naming the
    field, not a compile error or a silently wrong store."""

    import moe_ops.launch.dispatch_backward as db
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    T, H, I, E, K = 4, 16, 16, 3, 2
    args, g = _inputs(T, H, I, E, K, routing="uniform", seed=0, dtype=torch.float16)
    go = torch.randn(T, H, generator=g).to(torch.float16)
    cfg = dispatch_config(T, E, K, H, I, "cpu", torch.float16)
    bc = with_weight_grad(backward_config(cfg, "cpu", torch.float16), persistent=True,
                          **{field: value})
    with pytest.raises(ValueError, match=field):
        db.dispatch_backward_triton(go, *args, config=cfg, bwd_config=bc)


@needs_interpreter
@pytest.mark.parametrize("persistent,dtype", [(False, torch.float32), (True, torch.float16)])
def test_weight_grads_stop_after_the_valid_rows(interpreter, persistent, dtype):
    """An expert's weight-gradient sum stops at the first BLOCK_K step
    past its valid rows; the padding rows after that step are never read. Here they are NaN
    (the rows before, up to the step's end, are zero as in the backward), so a sum over every
    padded row shows. Expert counts 5 (one 16-row step of its 32), 21 (two), 40 and 0."""

    from moe_ops.launch.alignment import align_triton
    from moe_ops.launch._common import dot_precision as _dot_precision
    from moe_ops.launch.dispatch_backward import weight_grad_triton
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    E, M, N = 4, 24, 40
    counts = {0: 5, 1: 21, 3: 40}
    ids = torch.cat([torch.full((n,), e) for e, n in counts.items()])
    ids = ids[torch.randperm(ids.numel(), generator=g)].view(-1, 1).to(torch.int32)
    al = align_triton(ids, E, 32)
    cfg = dispatch_config(ids.shape[0], E, 1, M, N, "cpu", dtype)
    bc = with_weight_grad(backward_config(cfg, "cpu", dtype), persistent=persistent)
    bk = min(bc.weight_grad.block_k, al.block_m)
    assert bk == 16
    left = torch.full((al.max_rows, M), float("nan"), dtype=dtype)
    right = torch.full((al.max_rows, N), float("nan"), dtype=dtype)
    ref = torch.zeros(E, M, N, dtype=torch.float64)
    ends, valid_ends = al.expert_ends.tolist(), al.valid_ends.tolist()
    poisoned = 0
    for e in range(E):
        start, valid_end = (ends[e - 1] if e else 0), valid_ends[e]
        step_end = start + -(-(valid_end - start) // bk) * bk
        left[start:step_end] = 0
        right[start:step_end] = 0
        left[start:valid_end] = torch.randn(valid_end - start, M, generator=g).to(dtype)
        right[start:valid_end] = torch.randn(valid_end - start, N, generator=g).to(dtype)
        poisoned += ends[e] - step_end
        ref[e] = left[start:valid_end].double().t() @ right[start:valid_end].double()
    assert poisoned == 16 + 16, poisoned   # experts 0 and 3: a whole step past the valid rows
    out = torch.full((E, M, N), float("nan"), dtype=dtype)
    weight_grad_triton(left, right, out, al, bc.weight_grad, _dot_precision(dtype))
    assert rel_err(out, ref) <= RTOL[dtype], seed
    assert torch.equal(out[2], torch.zeros_like(out[2])), seed


@needs_interpreter
@pytest.mark.parametrize("routing", ["skewed", "balanced"])
def test_persistent_weight_grads_lpt_deal(interpreter, routing, monkeypatch):
    """The LPT deal itself, as each program walks it: tiles in the experts' LPT order (expert,
    output row block, column block), in rounds of NUM_PROGRAMS; where skewed, program p takes
    position p of even rounds and NUM_PROGRAMS-1-p of odd ones (the snake), else tile
    p + r*NUM_PROGRAMS. Recorded from every tile store of both weight-gradient launches
    (interpreter: the kernel's store helper is looked up at call time); each tile is stored
    once, by the program the deal gives it."""

    import moe_ops.kernels.expert_gemm_backward as kb
    import moe_ops.launch.dispatch_backward as db
    import triton.language as tl
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    seed = fresh_seed()
    T, H, I, E, K = 40, 32, 24, 12, 3
    args, g = _inputs(T, H, I, E, K, routing="uniform" if routing == "balanced" else routing,
                      seed=seed, dtype=torch.float16)
    if routing == "balanced":   # every expert 10 rows: the fixed deal
        args = (*args[:4], (torch.arange(T * K) % E).reshape(T, K).to(args[4].dtype))
    go = torch.randn(T, H, generator=g).to(torch.float16)
    cfg = dispatch_config(T, E, K, H, I, "cpu", torch.float16)
    bc = with_weight_grad(backward_config(cfg, "cpu", torch.float16), persistent=True,
                          persistent_chunk=2, lpt_schedule=True)
    stores, launches = [], []

    def store_slice(o_desc, x, e, m0, n0, ROWS, COLS, _run=kb._store_slice):
        stores.append(tuple(map(_interpreted_int, (tl.program_id(0), e, m0, n0))))
        return _run(o_desc, x, e, m0, n0, ROWS, COLS)

    def record(kernel, grid, a, kw):
        if kw.get("LPT"):
            launches.append((a[4], a[5], kw["BLOCK_M"], kw["BLOCK_N"], kw["NUM_PROGRAMS"],
                             list(stores)))
            stores.clear()

    monkeypatch.setattr(kb, "_store_slice", store_slice)
    spy_kernel_launches(monkeypatch, db, record)
    db.dispatch_backward_triton(go, *args, config=cfg, bwd_config=bc)
    monkeypatch.undo()
    assert len(launches) == 2, (seed, len(launches))   # dW2, dW13
    counts, skewed = expert_counts_skewed(args[4], E, db.LPT_MIN_SKEW)
    assert skewed == (routing == "skewed"), (seed, counts)
    order = sorted(range(E), key=lambda e: (-counts[e], e)) if skewed else list(range(E))
    for M, N, block_m, block_n, programs, got in launches:
        n_m, n_n = -(-M // block_m), -(-N // block_n)
        per_e = n_m * n_n
        assert programs > 1 and E * per_e > 2 * programs, (programs, E * per_e)
        expected = []
        for t in range(E * per_e):
            rnd, q = divmod(t, programs)
            p = programs - 1 - q if skewed and rnd % 2 else q
            rem = t % per_e
            expected.append((p, order[t // per_e], rem // n_n * block_m, rem % n_n * block_n))
        assert sorted(got) == sorted(expected), (seed, routing, M, N)


# ---------------------------------------------------------------------------------------------
# dW13 in column chunks of H (BackwardConfig.x_chunks): the same sums, bit-equal


@needs_interpreter
@pytest.mark.parametrize("case", ["plain", "persistent_f16", "w3", "weights_on_input",
                                  "transposed_w13"])
def test_x_chunks_match_one_chunk(interpreter, monkeypatch, case):
    """x gathered and dW13 computed in 2 and 4 column chunks of H: dx,
    dW2 and d topk_weights bit for bit as with one chunk, dW13 (and dW3) within rounding. Each
    dW13 element is the same sum over the rows, but the interpreter computes tl.dot with numpy,
    whose BLAS may order a sum differently for another tile width (float32: 2.4e-7 seen); on
    the GPU the chunks are bit-equal (tests/test_dispatch_backward_gpu.py)."""
    import dataclasses

    from moe_ops.launch.dispatch_backward import dispatch_backward_triton
    from moe_ops.ops.samples import make_variant_inputs
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    T, H, I, E, K = 19, 32, 12, 3, 2
    dtype = torch.float16 if case in ("persistent_f16", "w3") else torch.float32
    args, b13, b2 = make_variant_inputs(T, H, I, E, K, dtype=dtype, routing="negative",
                                        generator=g, transpose_w13=case == "transposed_w13")
    kw = {}
    if case == "weights_on_input":
        kw["weights_on_input"] = True
    if case == "w3":   # w13 is the gate alone [E, I, H], w3 the up projection
        w13 = args[1]
        args = (args[0], w13[:, :I].clone(), *args[2:])
        kw["w3"] = w13[:, I:].clone()
    go = torch.randn(T, H, generator=g).to(dtype)
    cfg = dispatch_config(T, E, K, H, I, "cpu", dtype)
    bc = dataclasses.replace(backward_config(cfg, "cpu", dtype), x_chunks=1)
    if case == "persistent_f16":
        bc = with_weight_grad(bc, persistent=True)
    _poison_empty(monkeypatch)
    one = dispatch_backward_triton(go, *args, config=cfg, bwd_config=bc, **kw)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    chunked = {1} | ({len(one) - 1} if case == "w3" else set())   # dW13, dW3
    for n in (2, 4):
        got = dispatch_backward_triton(go, *args, config=cfg,
                                       bwd_config=dataclasses.replace(bc, x_chunks=n), **kw)
        assert len(got) == len(one)
        for i, (a, b) in enumerate(zip(got, one)):
            if b is None:
                assert a is None
                continue
            assert not a.isnan().any(), (seed, case, n, i)
            assert a.stride() == b.stride(), (seed, case, n, i)
            if i in chunked:
                assert rel_err(a, b) <= tol, (seed, case, n, i, rel_err(a, b))
            else:
                assert torch.equal(a, b), (seed, case, n, i)


def test_x_chunks_rule_and_bad_values():
    """Automatic (the default): two chunks where gathered x is more than half of dz and the
    halves are multiples of 128 wide, else one; an explicit count must split H into widths that
    are multiples of 8 (a ValueError naming the field otherwise)."""
    import dataclasses

    from moe_ops.launch.dispatch_backward import x_chunks
    from moe_ops.tuning.heuristics import backward_config, dispatch_config

    bc = backward_config(dispatch_config(64, 8, 2, 64, 32, "cpu", torch.float32), "cpu",
                         torch.float32)
    assert bc.x_chunks == 0
    auto, bc = bc, dataclasses.replace(bc, x_chunks=1)
    rows = 70000
    # Qwen3-30B-A3B (H=2048, I=768): x is 1.33x dz -> 2 chunks
    assert x_chunks(auto, 2048, rows * 2048 * 2, rows * 1536 * 2) == 2
    # DeepSeek-V3 (H=7168, I=2048): x is 1.75x dz -> 2 chunks (never more)
    assert x_chunks(auto, 7168, rows * 7168 * 2, rows * 4096 * 2) == 2
    # OLMoE (H=2048, I=1024): x = dz -> 2 chunks
    assert x_chunks(auto, 2048, rows * 2048 * 2, rows * 2048 * 2) == 2
    # Mixtral (H=4096, I=14336): x well under dz -> 1
    assert x_chunks(auto, 4096, rows * 4096 * 2, rows * 28672 * 2) == 1
    # H=2880 (gpt-oss): no width that is a multiple of 128 -> 1
    assert x_chunks(auto, 2880, rows * 2880 * 2, rows * 2880 * 2) == 1
    assert x_chunks(bc, 2048, 1, 1) == 1
    assert x_chunks(bc, 17, 1, 1) == 1   # one chunk: any H
    for bad in (-1, 3, 512):
        with pytest.raises(ValueError, match="x_chunks"):
            x_chunks(dataclasses.replace(bc, x_chunks=bad), 2048, 1, 1)
