"""Dispatch configuration: heuristic, tuned tables (format pinned), nearest-T lookup, tune CLI."""
import json

import pytest
import torch
from expecttest import TestCase

from moe_ops.tuning import heuristics, tables
from moe_ops.tuning.configs import DispatchConfig
from moe_ops.tuning.heuristics import backward_config, dispatch_config, heuristic_config

CFG_A = DispatchConfig(block_m=16, gate_up_block_n=64, gate_up_block_k=128, down_block_n=64,
                       down_block_k=128, num_warps=4, num_stages=4)
CFG_B = DispatchConfig(block_m=128, gate_up_block_n=128, gate_up_block_k=64, down_block_n=256,
                       down_block_k=64, num_warps=8, num_stages=3)


def _entry(configs, H=2048, I=768, E=128, K=8, dtype="bfloat16"):
    return {"H": H, "I": I, "E": E, "K": K, "dtype": dtype,
            "configs": {str(t): tables.config_to_dict(c) for t, c in configs.items()}}


class TestTableFormat(TestCase):
    def test_format_is_pinned(self):
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            path = tables.write_table("NVIDIA H200", [_entry({1: CFG_A})], d, "3.6.0")
            self.assertEqual(path.name, "NVIDIA_H200.json")
            self.assertExpectedInline(path.read_text(), """\
{
 "device": "NVIDIA H200",
 "entries": [
  {
   "E": 128,
   "H": 2048,
   "I": 768,
   "K": 8,
   "configs": {
    "1": {
     "block_m": 16,
     "combine_in_down": false,
     "dependent_launch": false,
     "direct_rows": false,
     "down_block_k": 128,
     "down_block_n": 64,
     "down_combine_fused": false,
     "gate_up_block_k": 128,
     "gate_up_block_n": 64,
     "group_m": 8,
     "half_height_tails": false,
     "num_stages": 4,
     "num_warps": 4,
     "tma_down_activations": false,
     "tma_gate_up_pair": false,
     "tma_weights": false
    }
   },
   "dtype": "bfloat16"
  }
 ],
 "triton": "3.6.0",
 "version": 2
}
""")


def test_lookup_nearest_token_count_in_log_space(tmp_path):
    tables.write_table("GPU X", [_entry({1: CFG_A, 2048: CFG_B})], tmp_path)
    look = lambda T: tables.lookup(T, 128, 8, 2048, 768, torch.bfloat16, "GPU X", tmp_path)  # noqa: E731
    assert look(1) == CFG_A
    assert look(30) == CFG_A        # log distance: 30 is nearer 1 than 2048
    assert look(100) == CFG_B
    assert look(100000) == CFG_B
    assert tables.lookup(1, 128, 8, 2048, 768, torch.float16, "GPU X", tmp_path) is None
    assert tables.lookup(1, 64, 8, 2048, 768, torch.bfloat16, "GPU X", tmp_path) is None
    assert tables.lookup(1, 128, 8, 2048, 768, torch.bfloat16, "GPU Y", tmp_path) is None


def test_write_merges_token_counts(tmp_path):
    tables.write_table("G", [_entry({1: CFG_A})], tmp_path)
    tables.write_table("G", [_entry({512: CFG_B}), _entry({8: CFG_A}, E=64)], tmp_path)
    table = json.loads(tables.table_path("G", tmp_path).read_text())
    assert [sorted(e["configs"], key=int) for e in table["entries"]] == [["1", "512"], ["8"]]


def test_tables_live_outside_the_package(tmp_path, monkeypatch):
    """Without MOE_OPS_TUNING_DIR, tables are written to the user's cache (XDG_CACHE_HOME), never
    into the installed package (read-only site-packages; pip would not remove the file); lookup
    reads the user's table first, then one shipped in the package. With MOE_OPS_TUNING_DIR
    set, only that directory is read."""
    monkeypatch.delenv("MOE_OPS_TUNING_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    shipped = tmp_path / "package_configs"
    monkeypatch.setattr(tables, "_PACKAGE_DIR", shipped)
    tables._load.cache_clear()
    args = (64, 128, 8, 2048, 768, torch.bfloat16, "Dir GPU")
    assert tables.lookup(*args) is None
    tables.write_table("Dir GPU", [_entry({64: CFG_B})], directory=shipped)   # "shipped"
    assert tables.lookup(*args) == CFG_B
    path = tables.write_table("Dir GPU", [_entry({64: CFG_A})])
    assert path == tmp_path / "cache" / "moe_ops" / "tuning" / "Dir_GPU.json"
    assert tables.lookup(*args) == CFG_A   # the user's before the package's
    monkeypatch.setenv("MOE_OPS_TUNING_DIR", str(tmp_path / "empty"))
    assert tables.lookup(*args) is None
    # no home directory at all: lookup falls back to the package's table, writing says what to do
    monkeypatch.delenv("MOE_OPS_TUNING_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setattr(tables.Path, "home", classmethod(lambda cls: (_ for _ in ()).throw(
        RuntimeError("Could not determine home directory"))))
    assert tables.lookup(*args) == CFG_B
    with pytest.raises(RuntimeError, match="MOE_OPS_TUNING_DIR"):
        tables.write_table("Dir GPU", [_entry({64: CFG_A})])


def test_bad_tables_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="version"):
        tables.validate_table({"version": 99, "entries": []})
    bad = _entry({1: CFG_A})
    bad["configs"]["1"]["block_q"] = 3
    with pytest.raises(ValueError, match="unknown DispatchConfig fields"):
        tables.validate_table({"version": 2, "entries": [bad]})


@pytest.mark.parametrize("text", [
    '{"version": 2, "entries": [',                                          # truncated write
    '[]',                                                                     # not an object
    '{"version": 2, "entries": [{"H": 1}]}',                                  # entry lacks keys
    '{"version": 2, "entries": [{"H": 2048, "I": 768, "E": 128, "K": 8, "dtype": "bfloat16", '
    '"configs": {"64": {"block_m": 16}}}]}',                                  # config lacks fields
])
def test_broken_table_error_names_the_file(tmp_path, text):
    """Every moe.dispatch on a GPU with a table reads it: a broken one raised a bare
    JSONDecodeError / TypeError ("__init__() missing 6 required positional arguments") that
    named neither the file nor the fix."""
    tables._load.cache_clear()
    path = tables.table_path("Broken GPU", tmp_path)
    path.write_text(text)
    with pytest.raises(ValueError, match="Broken_GPU.json.*moe-ops-tune"):
        tables.lookup(64, 128, 8, 2048, 768, torch.bfloat16, "Broken GPU", tmp_path)
    tables._load.cache_clear()


def test_tune_refuses_a_broken_table_before_measuring(tmp_path, capsys):
    """The CLI merges into the existing table: a broken one is reported up front (it failed the
    write at the end, after every candidate had been timed)."""
    from moe_ops.tools import tune

    tables._load.cache_clear()
    tables.table_path("cpu-interpreter", tmp_path).write_text('{"version": 2, "entries": [')
    with pytest.raises(SystemExit) as e:
        tune.main(["--shape", "8,6,4,2", "--tokens", "1", "--device", "cpu", "--out-dir",
                   str(tmp_path)])
    assert e.value.code == 2
    assert "cpu-interpreter.json" in capsys.readouterr().err
    tables._load.cache_clear()


def test_dispatch_config_memo_follows_table_writes(tmp_path, monkeypatch):
    """dispatch_config is memoised; writing a table (moe_ops.tune) must not leave a stale
    answer, nor may another tuning folder or device name reuse one."""
    monkeypatch.setenv("MOE_OPS_TUNING_DIR", str(tmp_path))
    monkeypatch.setattr(heuristics, "_device_name", lambda: "Memo GPU")
    shape = (64, 128, 8, 2048, 768, "cuda", torch.bfloat16)
    assert dispatch_config(*shape) == heuristic_config(*shape)       # no table yet
    tables.write_table("Memo GPU", [_entry({64: CFG_A})], tmp_path)
    assert dispatch_config(*shape) == CFG_A
    tables.write_table("Memo GPU", [_entry({64: CFG_B})], tmp_path)
    assert dispatch_config(*shape) == CFG_B
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.setenv("MOE_OPS_TUNING_DIR", str(other))
    assert dispatch_config(*shape) == heuristic_config(*shape)
    monkeypatch.setenv("MOE_OPS_TUNING_DIR", str(tmp_path))
    monkeypatch.setattr(heuristics, "_device_name", lambda: "Another GPU")
    assert dispatch_config(*shape) == heuristic_config(*shape)


def test_dispatch_config_prefers_the_table_on_cuda(tmp_path, monkeypatch):
    tables.write_table("Fake GPU", [_entry({64: CFG_B})], tmp_path)
    monkeypatch.setenv("MOE_OPS_TUNING_DIR", str(tmp_path))
    monkeypatch.setattr(heuristics, "_device_name", lambda: "Fake GPU")
    tables._load.cache_clear()
    assert dispatch_config(64, 128, 8, 2048, 768, "cuda", torch.bfloat16) == CFG_B
    # another shape: heuristic
    assert dispatch_config(64, 64, 8, 2048, 768, "cuda", torch.bfloat16) == \
        heuristic_config(64, 64, 8, 2048, 768, "cuda", torch.bfloat16)


def test_heuristic_block_m_follows_rows_per_expert():
    ms = [heuristic_config(T, 128, 8, 2048, 768, "cuda", torch.bfloat16).block_m
          for T in (1, 128, 256, 512, 1024, 8192)]
    # rows per expert 0.06, 8, 16, 32, 64, 512: the smallest block >= mean + 2 sd, at most 128
    assert ms == [16, 16, 32, 64, 128, 128]
    f32 = heuristic_config(8192, 128, 8, 2048, 768, "cuda", torch.float32)
    assert f32.gate_up_block_k == f32.down_block_k == 32


def test_heuristic_path_switches():
    """Where the heuristic turns on the measured paths (docs/design.md, forward GEMMs)."""
    bf, f32 = torch.bfloat16, torch.float32
    mixtral, qwen3, deepseek = (4096, 14336, 8, 2), (2048, 768, 128, 8), (7168, 2048, 256, 8)

    def cfg(T, shape, dtype=bf):
        H, I, E, K = shape
        return heuristic_config(T, E, K, H, I, "cuda", dtype)

    for T in (1, 8, 512, 8192):
        for shape in (mixtral, qwen3, deepseek):
            c = cfg(T, shape)
            assert c.tma_weights and c.dependent_launch and c.direct_rows == (T == 1), (T, shape, c)
            assert not cfg(T, shape, f32).tma_weights   # float32 TMA tiles never measured
            assert cfg(T, shape, f32).direct_rows == (T == 1)
    # direct rows for a few tokens over many experts (T * K <= 32, E >= 64; 16-bit only)
    for T, shape, want in ((2, qwen3, True), (4, qwen3, True), (4, deepseek, True),
                           (5, qwen3, False), (2, mixtral, False), (16, mixtral, False)):
        c = cfg(T, shape)
        assert c.direct_rows == want and not c.down_combine_fused, (T, shape, c)
        assert not cfg(T, shape, f32).direct_rows
    # the folded combine only where cdiv(H, 32) >= 1.5 programs per SM (DeepSeek-V3's H)
    assert cfg(1, deepseek).down_combine_fused and cfg(1, deepseek).down_block_n == 32
    assert not cfg(1, qwen3).down_combine_fused and not cfg(1, mixtral).down_combine_fused
    assert not cfg(8, deepseek).down_combine_fused
    # elsewhere at T == 1 the down kernel's last program does the combine
    assert cfg(1, qwen3).combine_in_down and cfg(1, mixtral).combine_in_down
    # a 5th stage for the long weight streams of one token on Mixtral (I = 14336) alone
    assert cfg(1, mixtral).num_stages == 5 and cfg(8, mixtral).num_stages == 4
    assert cfg(1, qwen3).num_stages == 4 and cfg(1, deepseek).num_stages == 4
    assert cfg(1, mixtral, f32).num_stages == 3
    assert cfg(1, qwen3, f32).combine_in_down
    assert not cfg(1, deepseek).combine_in_down and not cfg(8, qwen3).combine_in_down
    # 4 stages at BLOCK_M 128 up to T=4096, 3 above; 256-wide down tiles at BLOCK_M 128 in
    # 16-bit, on long I or wide H with >= 256 rows per expert in float32
    assert cfg(2048, mixtral).num_stages == 4 and cfg(8192, mixtral).num_stages == 3
    assert cfg(8192, deepseek).down_block_n == 256 and cfg(2048, deepseek).down_block_n == 256
    assert cfg(8192, qwen3).down_block_n == 256 and cfg(512, mixtral).down_block_n == 256
    assert cfg(8192, qwen3, f32).down_block_n == 128 and cfg(512, qwen3).down_block_n == 128
    # gate and up tiles in one TMA copy at BLOCK_M 128 (16-bit only: float32 has no TMA)
    assert cfg(2048, qwen3).tma_gate_up_pair and cfg(8192, mixtral).tma_gate_up_pair
    assert not cfg(512, qwen3).tma_gate_up_pair and not cfg(8192, qwen3, f32).tma_gate_up_pair
    # half-height tail tiles wherever the row block is 128, never below
    assert cfg(2048, qwen3).half_height_tails and cfg(8192, deepseek).half_height_tails
    assert not cfg(512, qwen3).half_height_tails and not cfg(1, qwen3).half_height_tails
    # 32-wide, 256-deep gate+up steps at BLOCK_M 16 with several tokens on >= 64 experts
    #; not at T == 1, not on Mixtral's 8 experts, not in float32
    for T, shape in ((8, qwen3), (32, qwen3), (8, deepseek), (128, deepseek)):
        c = cfg(T, shape)
        assert (c.block_m, c.gate_up_block_n, c.gate_up_block_k, c.num_stages) == (16, 32, 256, 3), (T, c)
    for c in (cfg(1, qwen3), cfg(8, mixtral), cfg(8, qwen3, f32)):
        assert (c.gate_up_block_n, c.gate_up_block_k) != (32, 256), c
    # the down GEMM's act tiles by TMA at BLOCK_M 128 only (H200: slower at <= 64); the
    # backward's dA/dx A tiles where I <= 1024, 16-bit
    assert cfg(2048, qwen3).tma_down_activations and cfg(8192, mixtral).tma_down_activations and cfg(2048, deepseek).tma_down_activations
    assert not (cfg(512, qwen3).tma_down_activations or cfg(8, mixtral).tma_down_activations or cfg(1, qwen3).tma_down_activations
                or cfg(8192, qwen3, f32).tma_down_activations)
    back = {name: backward_config(cfg(8192, s), "cuda", bf, rows_per_expert=8192 * s[3] / s[2],
                                  inter_size=s[1])
            for name, s in (("qwen3", qwen3), ("mixtral", mixtral), ("deepseek", deepseek))}
    assert back["qwen3"].activation_grad_gemm.tma_activations
    assert back["qwen3"].input_grad_gemm.tma_activations
    assert not back["mixtral"].activation_grad_gemm.tma_activations
    assert not back["deepseek"].input_grad_gemm.tma_activations
    # the persistent weight gradients at every size (Mixtral: 2048 rows per
    # expert), and for an unknown size
    assert all(b.weight_grad.persistent and b.weight_grad.persistent_num_stages == 3
               and b.weight_grad.persistent_chunk == 32 for b in back.values())
    assert backward_config(cfg(8192, qwen3), "cuda", bf).weight_grad.persistent
    assert not backward_config(cfg(8192, qwen3, f32), "cuda", f32, 512.0, 768).weight_grad.persistent
    assert not backward_config(cfg(8192, qwen3, f32), "cuda", f32, 512.0,
                               768).activation_grad_gemm.tma_activations
    # interpreter configs never use the GPU-only paths
    cpu = heuristic_config(1, 8, 2, 64, 32, "cpu", f32)
    assert not (cpu.tma_weights or cpu.tma_down_activations or cpu.dependent_launch or cpu.down_combine_fused)


def test_pdl_launch_options_only_on_sm90(monkeypatch):
    import moe_ops.launch._common as launch

    assert launch.pdl_args(True, torch.device("cpu")) == {}
    assert launch.pdl_args(False, torch.device("cuda", 0)) == {}
    launch.sm90.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    assert launch.pdl_args(True, torch.device("cuda", 0)) == {}
    launch.sm90.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert launch.pdl_args(True, torch.device("cuda", 0)) == {"USE_PDL": True,
                                                                "launch_pdl": True}
    launch.sm90.cache_clear()


@pytest.mark.parametrize("T", [4, 200, 50000])   # one-launch scan; count + place; + column scan
@pytest.mark.parametrize("pdl", [True, False])
def test_alignment_launch_options_follow_the_forward(T, pdl):
    """moe.dispatch's forward launches its alignment kernels with programmatic dependent launch
    when its config has dependent_launch (they wait for the ids' producer, then let the gate+up kernel
    launch), and without it otherwise; the backward's own alignment never uses it. Launches
    captured on CPU tensors with the Hopper options on (moe_ops.tools.compile_check.capture)."""
    import dataclasses

    from moe_ops.tools.compile_check import forward_launches

    H, I, E, K = 64, 32, 16, 4
    cfg = dataclasses.replace(heuristic_config(T, E, K, H, I, "cuda", torch.bfloat16),
                              dependent_launch=pdl)
    launches = forward_launches((H, I, E, K), T, cfg, torch.bfloat16, backward=True)
    names = [ln.name for ln in launches]
    align = {"scan_kernel", "count_kernel", "place_kernel", "column_scan_kernel",
             "place_columns_kernel"}
    first_gemm = names.index("gate_up_kernel")
    fwd = [ln for ln in launches[:first_gemm] if ln.name in align]
    bwd = [ln for ln in launches[first_gemm:] if ln.name in align]
    assert [ln.name for ln in fwd] == {
        4: ["scan_kernel"], 200: ["count_kernel", "place_kernel"],
        50000: ["count_kernel", "column_scan_kernel", "place_columns_kernel"]}[T], names
    assert len(bwd) == len(fwd), names
    for ln in fwd:
        assert ln.kwargs.get("USE_PDL", False) is pdl and ln.kwargs.get("launch_pdl", False) is pdl
    for ln in bwd:
        assert "USE_PDL" not in ln.kwargs and "launch_pdl" not in ln.kwargs


def test_no_tma_descriptors_before_sm90(monkeypatch):
    """Before Hopper the TMA setting falls back to pointer loads (no descriptor is made)."""
    import moe_ops.launch._common as launch

    class FakeCudaTensor:
        is_cuda = True
        device = torch.device("cuda", 0)

    launch.sm90.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    assert launch.weight_desc(FakeCudaTensor(), [1, 16, 16]) is None
    launch.sm90.cache_clear()
    w = torch.zeros(2, 32, 32)   # CPU (interpreter): descriptors are made
    assert launch.weight_desc(w, [1, 16, 16]) is not None


def test_tune_cli_smoke_through_interpreter(interpreter, tmp_path, capsys):
    from moe_ops.tools import tune

    tune.main(["--shape", "24,20,4,2", "--tokens", "1", "9", "--device", "cpu", "--dtype",
               "float32", "--out-dir", str(tmp_path)])
    table = json.loads((tmp_path / "cpu-interpreter.json").read_text())
    assert sorted(table["entries"][0]["configs"], key=int) == ["1", "9"]
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 8, 128, 512, 2048, 8192])
def test_neighbours_distinct_and_valid(T, dtype):
    from moe_ops.tuning.heuristics import neighbours

    for H, I, E, K in [(4096, 14336, 8, 2), (2048, 768, 128, 8), (7168, 2048, 256, 8)]:
        base = heuristic_config(T, E, K, H, I, "cuda", dtype)
        cands = neighbours(base, dtype)
        assert next(iter(cands.values())) == base
        assert len(set(cands.values())) == len(cands) >= 5
        for cfg in cands.values():
            for v in (cfg.block_m, cfg.gate_up_block_n, cfg.gate_up_block_k, cfg.down_block_n, cfg.down_block_k):
                assert v >= 16 and v & (v - 1) == 0, cfg
            assert cfg.block_m <= 128 and cfg.num_warps in (4, 8)
            if dtype == torch.float32:   # shared memory: 32-deep steps, <= 3 stages
                assert cfg.gate_up_block_k <= 32 and cfg.down_block_k <= 32 and cfg.num_stages <= 3, cfg


def test_tune_quick_uses_neighbours():
    from moe_ops.tools import tune
    from moe_ops.tuning.heuristics import neighbours

    base = heuristic_config(512, 8, 2, 4096, 14336, "cuda", torch.bfloat16)
    got = tune.candidates(512, 8, 2, 4096, 14336, torch.bfloat16, "cuda", quick=True)
    assert got == list(neighbours(base).values())
    assert len(got) < len(tune.candidates(512, 8, 2, 4096, 14336, torch.bfloat16, "cuda"))


def test_tune_shape_times_each_candidate_with_its_own_config(monkeypatch):
    """tune_shape's timed call runs the candidate being measured (on the inputs of the token
    count being tuned), and the fastest one is what goes in the table. The kernels and the
    clock are stubbed: no interpreter needed."""
    from moe_ops.tools import tune

    calls = []

    def fake_dispatch(hidden, *rest, config):
        calls.append((hidden.shape[0], config))
        return torch.ones(hidden.shape[0], hidden.shape[1])

    timed = []

    def fake_time(fn, device_type):
        n = len(calls)
        fn()
        assert len(calls) == n + 1
        timed.append(calls[-1])
        return 2.0 if calls[-1][1] == cands[0] else 1.0   # the second candidate is faster

    monkeypatch.setattr(tune, "dispatch_triton", fake_dispatch)
    monkeypatch.setattr(tune, "_time", fake_time)
    H, I, E, K = 24, 20, 4, 2
    cands = tune.candidates(1, E, K, H, I, torch.float32, "cpu")
    assert len(cands) == 2 and cands[0] != cands[1]
    assert tune.candidates(9, E, K, H, I, torch.float32, "cpu") == cands
    entry = tune.tune_shape(H, I, E, K, [1, 9], torch.float32, torch.device("cpu"),
                            lambda desc: None)
    assert timed == [(T, c) for T in (1, 9) for c in cands]
    assert entry["configs"] == {"1": tables.config_to_dict(cands[1]),
                                "9": tables.config_to_dict(cands[1])}


def test_tune_shape_with_no_usable_candidate_names_the_shape(monkeypatch):
    """A token count whose every candidate fails (compile error, launch error) gets an error that
    names the shape and T, not a TypeError from the empty best."""
    from moe_ops.tools import tune

    def fake_dispatch(hidden, *rest, config):
        if config != heuristic:
            raise RuntimeError("out of resources")
        return torch.ones(hidden.shape[0], hidden.shape[1])

    H, I, E, K = 24, 20, 4, 2
    heuristic = tune.heuristic_config(1, E, K, H, I, "cpu", torch.float32)
    monkeypatch.setattr(tune, "dispatch_triton", fake_dispatch)
    monkeypatch.setattr(tune, "candidates", lambda *a, **k: [tune.dataclasses.replace(
        heuristic, num_warps=heuristic.num_warps * 2)])
    with pytest.raises(RuntimeError, match=r"every candidate .* H=24 I=20 E=4 K=2 T=1"):
        tune.tune_shape(H, I, E, K, [1], torch.float32, torch.device("cpu"), lambda desc: None)


# Quantized experts' entries (moe-ops-tune --weights): QuantDispatchConfig per weight format.

def _qcfg(**kw):
    from moe_ops.tuning.configs import QuantDispatchConfig

    return QuantDispatchConfig(**{**dict(block_m=16, block_n1=32, block_n2=64, block_k=256,
                                         mxfp4_swap_ab=True), **kw})


def _qentry(configs, weights, block_shape=None, H=2880, I=2880, E=32, K=4):
    return {**_entry(configs, H=H, I=I, E=E, K=K), "weights": weights, "block_shape": block_shape}


def test_quant_entries_round_trip_beside_unquantized_ones(tmp_path):
    from moe_ops.tuning.configs import QuantDispatchConfig

    Q1, Q2, F = _qcfg(), _qcfg(block_m=128, num_stages=4), _qcfg(block_n1=128, block_k=128)
    tables.write_table("G", [_entry({1: CFG_A}, H=2880, I=2880, E=32, K=4),
                             _qentry({1: Q1, 2048: Q2}, "mxfp4-mma"),
                             _qentry({8: F}, "fp8", [128, 128])], tmp_path)
    tables.write_table("G", [_qentry({8192: Q2}, "mxfp4-mma")], tmp_path)   # merges
    look = lambda T, **kw: tables.lookup(T, 32, 4, 2880, 2880, torch.bfloat16, "G", tmp_path, **kw)  # noqa: E731
    assert look(1) == CFG_A                                   # the unquantized entry
    assert look(1, weights="mxfp4-mma") == Q1
    assert isinstance(look(1, weights="mxfp4-mma"), QuantDispatchConfig)
    assert look(3000, weights="mxfp4-mma") == Q2
    assert look(1, weights="mxfp4") is None                    # another format
    assert look(8, weights="fp8", block_shape=[128, 128]) == F
    assert look(8, weights="fp8", block_shape=[128, 64]) is None
    assert look(8, weights="fp8-w8a16", block_shape=[128, 128]) is None
    table = json.loads(tables.table_path("G", tmp_path).read_text())
    assert len(table["entries"]) == 3
    assert sorted(table["entries"][1]["configs"], key=int) == ["1", "2048", "8192"]


@pytest.mark.parametrize("change,match", [
    (dict(weights="int4"), "weights must be one of"),
    (dict(weights="fp8", block_shape=None), "block_shape"),
    (dict(weights="fp8", block_shape=[128]), "block_shape"),
    (dict(weights="mxfp4", block_shape=[128, 128]), "block_shape null"),
    (dict(configs={"1": {"block_m": 16, "gate_up_block_n": 64}}), "unknown QuantDispatchConfig"),
    (dict(configs={"1": {"block_m": 16}}), "QuantDispatchConfig fields missing"),
])
def test_bad_quant_entries_are_rejected(change, match):
    entry = {**_qentry({1: _qcfg()}, "mxfp4"), **change}
    with pytest.raises(ValueError, match=match):
        tables.validate_table({"version": tables.FORMAT_VERSION, "entries": [entry]})


def test_quant_dispatch_config_prefers_the_table_on_cuda(tmp_path, monkeypatch):
    """On CUDA the quantized call's config comes from the tuned entry of its shape, hidden's
    dtype, weight format and FP8 block shape, else the heuristic; the memo follows table writes."""
    from moe_ops.tuning.heuristics import quant_dispatch_config, quant_heuristic_config

    monkeypatch.setenv("MOE_OPS_TUNING_DIR", str(tmp_path))
    monkeypatch.setattr(heuristics, "_device_name", lambda: "Quant GPU")
    shape = (1, 32, 4, 2880, 2880)
    heur = quant_heuristic_config(*shape, "mxfp4", 32, "cuda")
    look = lambda **kw: quant_dispatch_config(*shape, "mxfp4", 32, "cuda", **kw)  # noqa: E731
    assert look(dtype=torch.bfloat16, mma=True) == heur
    Q = _qcfg(num_stages=2)
    tables.write_table("Quant GPU", [_qentry({1: Q}, "mxfp4-mma")], tmp_path)
    assert look(dtype=torch.bfloat16, mma=True) == Q
    assert look(dtype=torch.bfloat16, mma=False) == heur       # the plain layout's entry: none
    assert look(dtype=torch.float16, mma=True) == heur
    assert look() == heur                                        # no dtype: the heuristic
    F = _qcfg(block_n1=128, block_k=128, num_warps=8)
    tables.write_table("Quant GPU", [_qentry({1: F}, "fp8", [128, 128], H=2048, I=768, E=128,
                                             K=8)], tmp_path)
    fp8 = lambda qa, bn: quant_dispatch_config(1, 128, 8, 2048, 768, "fp8", 128, "cuda", qa,  # noqa: E731
                                               dtype=torch.bfloat16, bn=bn)
    assert fp8(True, 128) == F
    assert fp8(False, 128) == quant_heuristic_config(1, 128, 8, 2048, 768, "fp8", 128, "cuda")
    assert fp8(True, 64) == quant_heuristic_config(1, 128, 8, 2048, 768, "fp8", 128, "cuda", True)


def test_quant_configs_follow_the_constraints(tmp_path, monkeypatch):
    from moe_ops.tuning import config_constraints, update_config_constraints
    from moe_ops.tuning.configs import QuantDispatchConfig
    from moe_ops.tuning.heuristics import quant_dispatch_config

    monkeypatch.setenv("MOE_OPS_TUNING_DIR", str(tmp_path))
    monkeypatch.setattr(heuristics, "_device_name", lambda: "Quant GPU 2")
    with config_constraints(QuantDispatchConfig, num_stages=2, mxfp4_one_factor=True):
        for dev, kw in (("cuda", dict(dtype=torch.bfloat16)), ("cuda", {}), ("cpu", {})):
            cfg = quant_dispatch_config(1, 32, 4, 2880, 2880, "mxfp4", 32, dev, **kw)
            assert (cfg.num_stages, cfg.mxfp4_one_factor) == (2, True), (dev, kw)
    assert quant_dispatch_config(1, 32, 4, 2880, 2880, "mxfp4", 32, "cuda",
                                 dtype=torch.bfloat16).num_stages == 3
    with pytest.raises(ValueError, match="no field"):
        update_config_constraints(QuantDispatchConfig, gate_up_block_n=64)


def test_tune_quant_keeps_only_candidates_bitwise_equal_to_the_heuristic(monkeypatch, capsys):
    """A faster candidate whose output differs from the heuristic config's in one bit is
    rejected (a tuned table must not make a token's output depend on the batch); the fastest
    bit-equal one goes in the table, with the entry's weight format. Kernels and clock stubbed."""
    from moe_ops.tools import quant_baselines as qb
    from moe_ops.tools import tune

    H, I, E, K = 64, 64, 4, 2
    qf = qb.FORMATS["mxfp4-mma"]
    base = tune.quant_heuristic_config(1, E, K, H, I, "mxfp4", 32, "cpu")
    off_by_one_bit, slower_equal, faster_equal = (
        _qcfg(block_n2=16), _qcfg(block_n2=32, num_stages=2), _qcfg(block_n2=32, num_stages=3))
    cands = [base, off_by_one_bit, slower_equal, faster_equal]
    monkeypatch.setattr(tune, "quant_candidates", lambda *a, **k: cands)

    def fake_dispatch(hidden, *rest, config, **kw):
        out = torch.full((hidden.shape[0], H), 0.5, dtype=torch.bfloat16)
        if config == off_by_one_bit:
            out.view(torch.int16)[-1, -1] += 1
        return out

    times = {base: 3.0, off_by_one_bit: 0.5, slower_equal: 2.0, faster_equal: 1.0}
    monkeypatch.setattr(tune, "dispatch_quantized", fake_dispatch)
    monkeypatch.setattr(tune, "_time", lambda fn, device_type: times[fn.keywords["config"]])
    entry = tune.tune_quant_shape(H, I, E, K, [1, 3], torch.bfloat16, torch.device("cpu"),
                                  lambda desc: None, qf)
    assert entry["weights"] == "mxfp4-mma" and entry["block_shape"] is None
    assert entry["configs"] == {"1": tables.config_to_dict(faster_equal),
                                "3": tables.config_to_dict(faster_equal)}
    err = capsys.readouterr().err
    assert err.count("rejected") == 2
    assert "1 of 64 outputs differ" in err and "1 of 192 outputs differ" in err   # T = 1, 3
    tables.validate_table({"version": tables.FORMAT_VERSION, "entries": [entry]})


def test_tune_quant_cli_smoke_through_interpreter(interpreter, tmp_path):
    from moe_ops.tools import tune

    tune.main(["--weights", "mxfp4", "--shape", "64,32,4,2", "--tokens", "1", "--device", "cpu",
               "--out-dir", str(tmp_path)])
    tune.main(["--weights", "fp8", "--shape", "64,32,4,2", "--tokens", "2", "--device", "cpu",
               "--out-dir", str(tmp_path)])
    table = json.loads((tmp_path / "cpu-interpreter.json").read_text())
    assert [(e["weights"], e["block_shape"], sorted(e["configs"])) for e in table["entries"]] == [
        ("mxfp4", None, ["1"]), ("fp8", [128, 128], ["2"])]
    with pytest.raises(SystemExit):
        tune.main(["--weights", "mxfp4-mma", "--shape", "96,32,4,2", "--device", "cpu",
                   "--out-dir", str(tmp_path)])


@pytest.mark.parametrize("name", ["fp8", "fp8-w8a16", "mxfp4", "mxfp4-mma"])
def test_quantized_call_asks_for_its_format_config(interpreter, monkeypatch, name):
    """dispatch_quantized asks quant_dispatch_config with hidden's dtype, the weight format
    (W8A8 or not, the MXFP4 layout) and FP8's bn: what selects a tuned entry on CUDA."""
    from moe_ops.launch import quant
    from moe_ops.tools import tune
    from moe_ops.tools.quant_baselines import FORMATS

    seen = []
    real = quant.quant_dispatch_config

    def spy(*args, **kw):
        seen.append((args, kw))
        return real(*args, **kw)

    monkeypatch.setattr(quant, "quant_dispatch_config", spy)
    qf = FORMATS[name]
    args, kw = tune.quant_inputs(2, 64, 64, 4, 2, qf, torch.bfloat16, "cpu")
    quant.dispatch_quantized(*args, **kw)
    (a, k), = seen
    assert a[5:] == (qf.fmt, 128 if qf.fmt == "fp8" else 32, "cpu", qf.quantize_activations)
    assert k == dict(dtype=torch.bfloat16, mma=qf.mxfp4_layout == "mma",
                     bn=128 if qf.fmt == "fp8" else 1)
