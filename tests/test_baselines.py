"""The benchmark's peers of moe_ops compute what they claim: on tiny shapes every gpt-oss peer
(moe_ops.tools.baselines.gpt_oss_baselines) matches the float64 reference of moe.dispatch with
gpt-oss's experts, and benchmarks/bench_variants.py --peers reports a wrong peer as wrong
without timing it."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from moe_ops.reference import dispatch_reference
from moe_ops.tools import baselines as bl

ROOT = Path(__file__).parents[1]
GPT_OSS = dict(activation="swiglu_oai", gate_up_interleaved=True, alpha=1.702, limit=7.0)
PEERS = ["torch_grouped_mm", "expert_loop", "hf_eager", "hf_grouped_mm", "hf_batched_mm"]


def _gpt_oss_inputs(T, H, I, E, K, dtype, seed=0):
    """Checkpoint storage [E, H, 2I] / [E, I, H] (moe.dispatch reads its transposed views),
    biases, softmax top-k routing. Weights large enough that swiglu_oai's clamps bite."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    gate_up = (torch.randn(E, H, 2 * I, generator=g) * 1.5).to(dtype)
    down = (torch.randn(E, I, H, generator=g) * 0.2).to(dtype)
    b13 = (torch.randn(E, 2 * I, generator=g) * 0.5).to(dtype)
    b2 = (torch.randn(E, H, generator=g) * 0.5).to(dtype)
    tw, ids = torch.randn(T, E, generator=g).softmax(-1).topk(K, -1)
    tw = tw / tw.sum(-1, keepdim=True)
    return hidden, gate_up, b13, down, b2, tw.float(), ids.int()


def _peer(name):
    b = {p.name: p for p in bl.gpt_oss_baselines()}[name]
    ok, why = bl.availability(b, torch.device("cpu"), torch.float32)
    if not ok:
        pytest.skip(f"{name}: {why}")
    return b


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("name", PEERS)
def test_gpt_oss_peer_matches_the_reference(name, dtype, tol):
    b = _peer(name)
    if dtype == torch.bfloat16 and b.needs_grouped_mm:
        ok, why = bl.grouped_mm_status(torch.device("cpu"), dtype)
        if not ok:
            pytest.skip(f"grouped_mm bf16 on CPU: {why}")
    T, H, I, E, K = 13, 32, 24, 6, 2
    hidden, gate_up, b13, down, b2, tw, ids = _gpt_oss_inputs(T, H, I, E, K, dtype)
    ref = dispatch_reference(hidden.double(), gate_up.transpose(1, 2), down.transpose(1, 2), tw,
                             ids, w13_bias=b13, w2_bias=b2, **GPT_OSS)
    # the clamps are exercised: some gate values above limit, some up values outside +-limit
    h = torch.einsum("th,ehn->ten", hidden.double(), gate_up.double())
    assert (h[..., 0::2] > 7.0).any() and (h[..., 1::2].abs() > 7.0).any()
    ids_in = ids.long() if b.int64_ids else ids
    out = b.fn(hidden, gate_up, b13, down, b2, tw, ids_in)
    assert out.dtype == dtype and out.shape == (T, H)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err <= tol, (name, dtype, err)
    bl.clear_caches()


def test_gpt_oss_hf_peers_run_transformers_code():
    """The hf_* peers are transformers' GptOssExperts on the given tensors (no copy), with the
    experts implementation each name says."""
    pytest.importorskip("transformers")
    T, H, I, E, K = 5, 32, 24, 4, 2
    hidden, gate_up, b13, down, b2, tw, ids = _gpt_oss_inputs(T, H, I, E, K, torch.float32)
    for impl in bl.hf_experts_implementations():
        experts = bl.build_hf_gpt_oss_experts(gate_up, b13, down, b2, K, impl)
        assert type(experts).__name__ == "GptOssExperts"
        assert experts.config._experts_implementation == impl
        assert experts.gate_up_proj.data_ptr() == gate_up.data_ptr()
        assert experts.down_proj_bias.data_ptr() == b2.data_ptr()
        assert experts.limit == 7.0 and experts.alpha == 1.702


def test_gpt_oss_peers_keep_the_mixtral_names():
    """The bench's gpt_oss_20b rows fill the same columns with the gpt-oss computations."""
    assert [b.name for b in bl.gpt_oss_baselines()] == [b.name for b in bl.baselines()]
    assert all(b.experts == "gpt_oss" for b in bl.gpt_oss_baselines())


def _bench_variants(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_script_bench_variants",
                                                  ROOT / "benchmarks" / "bench_variants.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)
    return mod


def test_bench_variants_reports_a_wrong_peer_without_timing_it(monkeypatch):
    mod = _bench_variants(monkeypatch)
    ref = torch.randn(4, 8, dtype=torch.float64)
    timed = []

    def time_fn(fn):
        timed.append(fn)
        return 1.0

    st, us, err = mod.check_then_time("wrong", lambda: (ref * 1.1).float(), ref, 2e-2, time_fn)
    assert (st, us) == ("WRONG", None) and err == pytest.approx(0.1) and not timed
    st, us, err = mod.check_then_time("nan", lambda: torch.full((4, 8), float("nan")), ref, 2e-2,
                                      time_fn)
    assert (st, us) == ("WRONG", None) and not timed

    def boom():
        raise RuntimeError("no kernel")
    assert mod.check_then_time("err", boom, ref, 2e-2, time_fn)[:2] == ("ERR", None)
    assert not timed
    st, us, err = mod.check_then_time("right", lambda: ref.float(), ref, 2e-2, time_fn)
    assert (st, us) == ("ok", 1.0) and err < 1e-6 and len(timed) == 1


def test_bench_variants_peer_args_are_the_checkpoint_storage(monkeypatch):
    mod = _bench_variants(monkeypatch)
    T, H, I, E, K = 5, 32, 24, 4, 2
    hidden, gate_up, b13, down, b2, tw, ids = _gpt_oss_inputs(T, H, I, E, K, torch.float32)
    kw = dict(w13_bias=b13, w2_bias=b2, **GPT_OSS)
    args = (hidden, gate_up.transpose(1, 2), down.transpose(1, 2), tw, ids, kw)
    for b in bl.gpt_oss_baselines():
        call = mod.gpt_oss_peer_args(args, b)
        assert call[1].data_ptr() == gate_up.data_ptr() and call[1].is_contiguous()
        assert call[3].data_ptr() == down.data_ptr() and call[3].is_contiguous()
        assert call[6].dtype == (torch.int64 if b.int64_ids else torch.int32)
