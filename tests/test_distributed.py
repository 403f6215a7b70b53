"""moe_ops.distributed (expert parallelism) on multi-process gloo groups, CPU.

One spawned process group per world size (2 and 4) runs every case of tests/ep_cases.py (parity
with single-process moe.dispatch on the full weights, forward and backward, both forms, the
sync-free mode, routing edge cases, set-up and argument errors, torch._dynamo.explain); each case
is then reported as its own test. A further group checks that a rank dying mid-layer makes the
others fail with torch.distributed's error, not a hang."""
from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
import ep_cases  # noqa: E402

# the explain case traces with dynamo in every rank: run it once, at world size 2
# and the transformers cases (a model load per rank)
_SLOW = {"compiled"}   # inductor compiles in every rank: ~1 min
_W2_ONLY = {"dynamo_explain", "hf_apply_moe_ops_expert_parallel", "hf_shard_experts_replicated",
            "hf_transformers_ep_plan"}


def _spawn(fn, args, nprocs, timeout_s=400):
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise AssertionError(f"the spawned ranks did not finish within {timeout_s} s")


def _results(W, names, tmp_path_factory, timeout_s=60.0):
    """`timeout_s`: the group's timeout, also the rendezvous's: on 2 loaded cores one rank can
    start (import torch) or compile (torch.compile) tens of seconds after another."""
    d = tmp_path_factory.mktemp(f"ep_w{W}")
    _spawn(ep_cases.run_cases, (W, str(d / "store"), names, str(d), "cpu", torch.float64,
                                timeout_s, True), W)
    out = {}
    for r in range(W):
        with open(d / f"rank{r}.json") as f:
            out[r] = json.load(f)
    return out


_NAMES = sorted(set(ep_cases.CASES) - _SLOW)


@pytest.fixture(scope="module")
def results_w2(tmp_path_factory):
    return _results(2, _NAMES, tmp_path_factory)


@pytest.fixture(scope="module")
def results_w4(tmp_path_factory):
    return _results(4, [n for n in _NAMES if n not in _W2_ONLY], tmp_path_factory)


def _check(results, name):
    skips = {res.get(name) for res in results.values() if str(res.get(name)).startswith("skip:")}
    if skips and len(skips) == 1 and all(str(res.get(name)).startswith("skip:")
                                          for res in results.values()):
        pytest.skip(skips.pop()[len("skip: "):])
    failures = {r: res.get(name, "not run (an earlier case hung or crashed the rank)")
                for r, res in results.items() if res.get(name) != "ok"}
    assert not failures, "\n".join(f"rank {r}:\n{tb}" for r, tb in failures.items())


@pytest.mark.parametrize("name", _NAMES)
def test_world_size_2(results_w2, name):
    _check(results_w2, name)


@pytest.mark.parametrize("name", [n for n in _NAMES if n not in _W2_ONLY])
def test_world_size_4(results_w4, name):
    _check(results_w4, name)


@pytest.mark.slow
def test_compiled(tmp_path_factory):
    _check(_results(2, ["compiled"], tmp_path_factory, timeout_s=300.0), "compiled")


def test_not_initialised():
    from moe_ops.distributed import ExpertParallelGroup, expert_parallel_dispatch

    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    w13, w2 = torch.zeros(2, 4, 3), torch.zeros(2, 3, 2)
    with pytest.raises(ValueError, match="group: the torch.distributed process group is not"):
        ExpertParallelGroup.setup(w13, w2, first_expert=0, num_experts=4)
    with pytest.raises(ValueError, match="init_process_group"):
        expert_parallel_dispatch(torch.zeros(1, 3), w13, w2, torch.ones(1, 1),
                                 torch.zeros(1, 1, dtype=torch.int32), first_expert=0,
                                 num_experts=4)


def test_bad_arguments_before_any_collective():
    # argument errors are raised before the group is looked at
    from moe_ops.distributed import expert_parallel_dispatch

    w13, w2 = torch.zeros(2, 4, 3), torch.zeros(2, 3, 2)
    x, w, ids = torch.zeros(2, 3), torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(TypeError, match="topk_ids must be int32 or int64"):
        expert_parallel_dispatch(x, w13, w2, w, ids.float(), first_expert=0, num_experts=4)
    with pytest.raises(ValueError, match="topk_weights must be"):
        expert_parallel_dispatch(x, w13, w2, w[:1], ids, first_expert=0, num_experts=4)
    with pytest.raises(TypeError, match="first_expert must be an int"):
        expert_parallel_dispatch(x, w13, w2, w, ids, first_expert=0.0, num_experts=4)
    with pytest.raises(TypeError, match="hidden must be a torch.Tensor"):
        expert_parallel_dispatch([1], w13, w2, w, ids, first_expert=0, num_experts=4)


# ------------------------------------------------------------------------------------------------
# A rank that dies mid-layer


def _dying_rank(rank, W, store_path, out_dir, timeout_s, how):
    from moe_ops.distributed import even_shard, expert_parallel_dispatch

    dist.init_process_group("gloo", store=dist.FileStore(store_path, W), rank=rank,
                            world_size=W, timeout=datetime.timedelta(seconds=timeout_s))
    E, H, I = 2 * W, 8, 6
    first, count = even_shard(E, W, rank)
    w13, w2 = torch.randn(count, 2 * I, H), torch.randn(count, H, I)
    x, w = torch.randn(4, H), torch.rand(4, 2)
    ids = torch.randint(0, E, (4, 2), dtype=torch.int32)

    def call():
        return expert_parallel_dispatch(x, w13, w2, w, ids, first_expert=first, num_experts=E)

    call()   # one good layer (and the set-up check)
    if rank == W - 1:
        if how == "stall":   # alive but never makes the next layer's collectives
            time.sleep(timeout_s + 30)
        os._exit(3)   # dies before the next layer's exchange
    t0 = time.monotonic()
    try:
        call()
        outcome = "no error"
    except Exception as e:  # noqa: BLE001
        outcome = f"{type(e).__module__}.{type(e).__name__}: {str(e)[:300]}"
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"outcome": outcome, "seconds": time.monotonic() - t0}, f)
    os._exit(0)   # destroy_process_group would wait for the dead peer


@pytest.mark.slow   # ~15 s: two process start-ups (the error itself comes in < 0.1 s)
@pytest.mark.parametrize("how", ["exit", "stall"])
def test_rank_dies_mid_layer(tmp_path, how):
    """A rank that exits (the others see gloo's "connection closed by peer" at once) or stalls
    (the others time out after the group's 5 s timeout): an error from torch.distributed, no
    hang."""
    W, timeout_s = 2, 5.0
    ctx = mp.start_processes(_dying_rank, args=(W, str(tmp_path / "store"), str(tmp_path),
                                                timeout_s, how),
                             nprocs=W, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    ctx.processes[0].join(timeout=max(deadline - time.monotonic(), 1))
    survivor_alive = ctx.processes[0].is_alive()
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    assert not survivor_alive, "a surviving rank hung past the group's timeout"
    with open(tmp_path / "rank0.json") as f:
        res = json.load(f)
    assert res["outcome"] != "no error", res
    assert "torch" in res["outcome"] or "Error" in res["outcome"], res
    # the error comes from torch.distributed within the group's timeout (plus start-up slack)
    assert res["seconds"] < timeout_s + 15, res
    if how == "stall":   # gloo: "Timed out waiting 5000ms for send operation to complete"
        assert res["seconds"] > 0.8 * timeout_s and "Timed out" in res["outcome"], res


del multiprocessing


def test_bench_ep_smoke(tmp_path):
    """benchmarks/bench_ep.py on one gloo CPU process (the exchange itself is covered by the
    parity cases), tiny shape: every mode reports a row per T, with the phase times of the
    all-to-all forms."""
    import csv
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    out = tmp_path / "ep.csv"
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "bench_ep.py"), "--tiny", "--nprocs",
         "1", "--tokens", "0", "3", "--iters", "1", "--warmup", "0", "--modes", "all_to_all",
         "sync_free", "pipelined", "replicated", "--csv", str(out)],
        check=False, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 4, rows   # T x modes
    for r in rows:
        assert float(r["layer_us"]) > 0, r
        if r["mode"] in ("all_to_all", "sync_free"):
            assert all(float(r[k]) > 0 for k in ("a2a_us", "compute_us", "combine_us")), r
            assert r["rows_in"] == ("0" if r["T"] == "0" else "3"), r   # W = 1: every token
    assert "a2a_us" in proc.stdout
