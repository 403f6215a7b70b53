"""Dispatch configuration: heuristic, tuned tables (format pinned), nearest-T lookup, tune CLI."""
import json
import warnings

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
