"""DispatchConfig.ids_rows (small T*K): each expert's rows are found from the ids inside the
gate+up kernel, with no alignment launch; the down kernel reads the tables it writes.
Interpreted Triton kernels on the CPU: against float64, and bitwise against the aligned path
(the same rows in the same order in every tile), NaN-poisoned scratch and outputs."""
import dataclasses

import pytest
import torch

from conftest import needs_interpreter, rel_err
from test_dispatch import _dense_float64
from test_training_modes import _double, _inputs, _poison_empty, _z_err, fresh_seed


def _run(args, cfg, monkeypatch, save_z=False):
    import moe_ops.launch.dispatch as launch

    aligns = []
    real = launch.align_triton
    _poison_empty(monkeypatch)
    monkeypatch.setattr(launch, "align_triton", lambda *a, **kw: aligns.append(1) or real(*a, **kw))
    T, H = args[0].shape
    out = torch.full((T, H), float("nan"), dtype=args[0].dtype)
    res = launch.dispatch_triton(*args, config=cfg, out=out, save_z=save_z)
    monkeypatch.undo()
    return res, len(aligns)


@needs_interpreter
@pytest.mark.parametrize("routing", ["uniform", "negative", "mixed", "one_expert",
                                     "empty_experts", "repeated"])
@pytest.mark.parametrize("T,K,H,I,E", [(2, 4, 33, 40, 6), (3, 8, 24, 70, 40), (8, 2, 40, 37, 5),
                                       (20, 3, 17, 48, 4), (16, 8, 16, 16, 200)])
@pytest.mark.parametrize("tma", [False, True])
def test_ids_rows_match_aligned(interpreter, monkeypatch, routing, T, K, H, I, E, tma):
    """T*K from 8 to 128 slots, E above and below T*K, odd H and I; ids < 0; one expert taking
    every slot (up to 128 rows: several 16-row chunks of one block); ids repeated within tokens;
    empty experts. The ids-rows path launches no alignment and gives the aligned path's output
    bit for bit (and its z in a training forward)."""
    from moe_ops.tuning.heuristics import dispatch_config

    seed = fresh_seed()
    base = "uniform" if routing == "repeated" else routing
    args, g = _inputs(T, H, I, E, K, routing=base, seed=seed)
    if routing == "repeated":   # some tokens send several slots to one expert
        ids = args[4].clone()
        ids[::2, 1:] = ids[::2, :1]
        args = (*args[:4], ids)
    aligned = dataclasses.replace(dispatch_config(T, E, K, H, I, "cpu", torch.float32), tma=tma)
    assert aligned.block_m == 16 and not aligned.direct
    cfg = dataclasses.replace(aligned, ids_rows=True)
    (out, z), n_align = _run(args, cfg, monkeypatch, save_z=True)
    assert n_align == 0
    assert rel_err(out, _dense_float64(*_double(args))) <= 1e-5, seed
    assert _z_err(z, args) <= 1e-5, seed
    (ref, ref_z), n_align = _run(args, aligned, monkeypatch, save_z=True)
    assert n_align == 1
    assert torch.equal(out, ref), seed
    valid = ((args[4] >= 0) & (args[4] < E)).reshape(-1)
    assert torch.equal(z[valid], ref_z[valid]), seed
    out2, _ = _run(args, cfg, monkeypatch)
    assert torch.equal(out2, out), seed


@needs_interpreter
def test_ids_rows_falls_back_past_128_slots(interpreter, monkeypatch):
    """Above IDS_ROWS_MAX_SLOTS slots the setting is ignored: the alignment runs."""
    from moe_ops.launch.dispatch import IDS_ROWS_MAX_SLOTS
    from moe_ops.tuning.heuristics import dispatch_config

    seed = fresh_seed()
    T, K, H, I, E = IDS_ROWS_MAX_SLOTS // 2 + 1, 2, 16, 16, 6
    args, _ = _inputs(T, H, I, E, K, routing="negative", seed=seed)
    cfg = dataclasses.replace(dispatch_config(T, E, K, H, I, "cpu", torch.float32),
                              ids_rows=True)
    out, n_align = _run(args, cfg, monkeypatch)
    assert n_align == 1
    assert rel_err(out, _dense_float64(*_double(args))) <= 1e-5, seed
