"""`python -m moe_ops.bench`: the tiny CPU run prints a row per (shape, T) with a moe_ops time, and
writes the CSV, Markdown and (with matplotlib) PNG outputs; --plot without matplotlib is refused
before any benchmarking; the plotted series follow the table's figures."""
import csv
import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import env_without_interpreter
from moe_ops.tools import bench

ROOT = Path(__file__).parents[1]
SHAPE = "qwen3_30b_a3b"
TOKENS = [1, 8]
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CSV_HEADER = ["shape", "weights", "T", "impl", "status", "eager_us", "graph_us", "best_us",
              "best_how", "rel_err", "graph_rel_err", "w8a8_rel_err", "floor_us", "floor_fraction",
              "bytes", "flops", "experts_hit", "max_over_mean_load", "route_eager_us",
              "route_graph_us", "note"]


def _run(args, code=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.pop("TRITON_INTERPRET", None)   # the CPU path's torch reference: seconds, not minutes
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "moe_ops.bench"]
    return subprocess.run(cmd + args, capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    args = ["--tiny", "--shapes", SHAPE, "--tokens", *map(str, TOKENS),
            "--csv", str(out / "bench.csv"), "--md", str(out / "bench.md")]
    if HAS_MATPLOTLIB:
        args += ["--plot", str(out / "bench.png")]
    r = _run(args)
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r, out


def _table_rows(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    head = [i for i, line in enumerate(lines) if line.startswith("shape ") and "floor/moe_ops" in line]
    assert len(head) == 1, stdout
    assert set(lines[head[0] + 1].replace(" ", "")) == {"-"}
    return [line.split() for line in lines[head[0] + 2:] if line.strip()]


def test_help():
    r = _run(["--help"])
    assert r.returncode == 0, r.stderr
    assert "--plot PATH.png" in r.stdout and "--tiny" in r.stdout


def test_tiny_table_has_a_moe_ops_time_per_cell(tiny_run):
    r, _ = tiny_run
    rows = _table_rows(r.stdout)
    assert [(row[0], int(row[1])) for row in rows] == [(SHAPE, T) for T in TOKENS], rows
    for row in rows:
        # shape, T, floor, route e/g, moe_ops e/g, ...: eager time / graph time ("-" on CPU)
        assert re.fullmatch(r"\d+(\.\d+)?/(\d+(\.\d+)?|-)", row[4]), row
        assert "FAIL" not in row, row
    assert not re.search(r"^  \S+ T=\d+ \S+: FAIL", r.stdout, re.M), r.stdout


def test_tiny_csv_and_md(tiny_run):
    _, out = tiny_run
    with open(out / "bench.csv", newline="") as f:
        rows = [row for row in csv.reader(f) if not row[0].startswith("# ")]
    assert rows[0] == CSV_HEADER
    records = [dict(zip(CSV_HEADER, row)) for row in rows[1:]]
    assert [(d["shape"], int(d["T"]), d["impl"]) for d in records] == [
        (SHAPE, T, impl) for T in TOKENS for impl in bench.IMPLS]
    assert {d["weights"] for d in records} == {"bf16"}
    for d in records:
        if d["impl"] == "moe_ops":
            assert d["status"] == "ok" and float(d["best_us"]) > 0, d
            assert float(d["floor_fraction"]) == pytest.approx(
                float(d["floor_us"]) / float(d["best_us"]), rel=1e-4)
        assert d["status"] != "FAIL", d
    md = (out / "bench.md").read_text()
    assert md.startswith("# moe_ops forward benchmark") and f"| {SHAPE} | 8 |" in md


def _csv_records(path):
    with open(path, newline="") as f:
        rows = [row for row in csv.reader(f)]
    env = {row[0][2:]: row[1] for row in rows if row[0].startswith("# ")}
    rows = [row for row in rows if not row[0].startswith("# ")]
    assert rows[0] == CSV_HEADER
    return env, [dict(zip(CSV_HEADER, row)) for row in rows[1:]]


@pytest.mark.parametrize("weights,shape", [("fp8", "qwen3_30b_a3b"), ("mxfp4", "gpt_oss_20b"),
                                           ("mxfp4-mma", "gpt_oss_20b")])
def test_tiny_quantized_weights_run_and_write_the_weights_column(weights, shape, tmp_path):
    """--weights fp8 / mxfp4 / mxfp4-mma on tiny shapes on the CPU: every quantized implementation checked
    and timed (scaled_grouped_mm, which has no CPU kernel, n/a with its reason and no number),
    the weights column filled, moe_ops W8A8 also checked against the W8A8 reference."""
    csv_path = tmp_path / "q.csv"
    r = _run(["--tiny", "--weights", weights, "--shapes", shape, "--tokens", "1", "8",
              "--warmup-ms", "1", "--rep-ms", "5", "--csv", str(csv_path)])
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    env, records = _csv_records(csv_path)
    assert "triton" in env and "ceilings" in env
    assert ("fp8 torch._scaled_mm" in env["ceilings"]) == (weights == "fp8")
    assert [(d["shape"], d["weights"], int(d["T"]), d["impl"]) for d in records] == [
        (shape, weights, T, impl) for T in (1, 8) for impl in bench.QUANT_IMPLS]
    for d in records:
        assert d["status"] != "FAIL", d
        if d["status"] == "ok":
            assert float(d["best_us"]) > 0 and float(d["rel_err"]) < 6e-2, d
            assert float(d["floor_fraction"]) == pytest.approx(
                float(d["floor_us"]) / float(d["best_us"]), rel=1e-4)
        elif d["status"] == "skip" and "budget" in d["note"]:
            # checked, then one call over --max-call-ms (a loaded CPU): its error, no time
            assert d["best_us"] == d["eager_us"] == "" and float(d["rel_err"]) < 6e-2, d
        else:
            assert d["best_us"] == d["eager_us"] == d["rel_err"] == "" and d["note"], d
        has_w8a8 = weights == "fp8" and d["impl"] == "moe_ops"
        assert (d["w8a8_rel_err"] != "") == has_w8a8, d
        if has_w8a8:
            assert float(d["w8a8_rel_err"]) < 1e-2, d
    by_impl = {d["impl"]: d for d in records if d["T"] == "8"}
    for impl in ("moe_ops", "deq_moe_ops", "predequantized"):
        assert by_impl[impl]["status"] == "ok", by_impl[impl]
    if not __import__("torch").cuda.is_available():
        sgmm = by_impl["scaled_grouped_mm"]
        assert sgmm["status"] == "n/a" and sgmm["note"], sgmm
    rows = _table_rows(r.stdout)
    assert [(row[0], int(row[1])) for row in rows] == [(shape, 1), (shape, 8)]


def test_quant_floor_counts_quantized_bytes():
    s = bench.SHAPES["deepseek_v3_routed"]
    fp8 = bench.qb.FORMATS["fp8"]
    n_bytes, flops = bench.quant_floor_terms(s, 8, 50, 2, fp8)
    scales = 4 * (2 * 2048 // 128 * 7168 // 128 + 7168 // 128 * 2048 // 128)
    assert n_bytes == 50 * (3 * 7168 * 2048 + scales) + 2 * 8 * 7168 * 2
    assert flops == 2 * 8 * 8 * 3 * 7168 * 2048
    g = bench.SHAPES["gpt_oss_20b"]
    n_bytes, _ = bench.quant_floor_terms(g, 1, 4, 2, bench.qb.FORMATS["mxfp4"])
    assert n_bytes == 4 * (3 * 2880 * 2880 // 2 + 3 * 2880 * 2880 // 32) + 2 * 2880 * 2


def test_run_impl_never_times_a_wrong_output():
    """A wrong output (against the float64 reference, or moe_ops W8A8 against the W8A8
    reference) is FAIL with no time; a right one is timed."""
    import argparse

    import torch

    class CountingTimer(bench.Timer):
        calls = 0

        def __call__(self, fn):
            CountingTimer.calls += 1
            return 1.0

    timer = CountingTimer(torch.device("cpu"), 1.0, 1.0)
    ref = torch.randn(4, 8, dtype=torch.float64)
    opts = argparse.Namespace(max_call_ms=1e9)
    s = bench.SHAPES["olmoe"]

    def run(out, w8a8_ref=None):
        b = bench.bl.Baseline("x", lambda: out, capturable=False)
        return bench.run_impl("x", b, lambda _b: (), ref, 2e-2, timer, False, opts, s, 4, None,
                              w8a8_ref=w8a8_ref)

    r = run((ref * 1.5).float())
    assert r.status == "FAIL" and r.best_us is None and "not timed" in r.note
    r = run(ref.float(), w8a8_ref=(ref * 1.5, 1e-2))
    assert r.status == "FAIL" and r.best_us is None and r.w8a8_rel_err == pytest.approx(1 / 3)
    assert CountingTimer.calls == 0
    r = run(ref.float(), w8a8_ref=(ref, 1e-2))
    assert r.status == "ok" and r.eager_us == 1000.0 and r.w8a8_rel_err < 1e-6
    assert CountingTimer.calls == 1


def test_tiny_gpt_oss_shape_times_the_gpt_oss_peers(tmp_path):
    """The bench's gpt_oss_20b rows run the gpt-oss peers (no longer n/a), checked against the
    float64 reference of gpt-oss's experts."""
    csv_path = tmp_path / "g.csv"
    impls = ["moe_ops", "torch_grouped_mm", "expert_loop", "hf_grouped_mm"]
    r = _run(["--tiny", "--shapes", "gpt_oss_20b", "--tokens", "8", "--impls", *impls,
              "--warmup-ms", "1", "--rep-ms", "5", "--csv", str(csv_path)])
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    _, records = _csv_records(csv_path)
    assert [d["impl"] for d in records] == impls
    for d in records:
        assert d["status"] in ("ok", "n/a"), d
        if d["status"] == "n/a":
            assert "Mixtral" not in d["note"], d
        else:
            assert float(d["rel_err"]) < 2e-2, d
    assert records[2]["status"] == "ok"   # expert_loop: plain torch, runs everywhere


@pytest.mark.gpu
@pytest.mark.parametrize("args", [
    ["--weights", "fp8", "--shapes", "qwen3_30b_a3b"],
    ["--weights", "fp8-w8a16", "--shapes", "qwen3_30b_a3b"],
    ["--weights", "mxfp4", "--shapes", "gpt_oss_20b"],
    ["--shapes", "gpt_oss_20b"],
], ids=["fp8", "fp8-w8a16", "mxfp4", "bf16-gpt-oss-peers"])
def test_gpu_bench_real_shapes_check_and_time_everything(args, tmp_path):
    """On the GPU at real shapes: every implementation passes its float64 check (W8A8 also the
    W8A8 reference) and is timed, moe_ops also as a graph replay; only scaled_grouped_mm (a
    torch without its kernel) and transformers' peers (not installed, or batched_mm over its
    memory budget) may be n/a or skip."""
    csv_path = tmp_path / "gpu.csv"
    r = _run(args + ["--tokens", "1", "128", "--warmup-ms", "2", "--rep-ms", "10",
                     "--csv", str(csv_path)])
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    _, records = _csv_records(csv_path)
    assert records and not [d for d in records if d["status"] in ("FAIL", "ERR", "OOM")], \
        r.stdout[-4000:]
    for d in records:
        if d["impl"] in ("moe_ops", "deq_moe_ops", "predequantized", "torch_grouped_mm",
                         "expert_loop"):
            assert d["status"] == "ok" and float(d["best_us"]) > 0, d
        if d["impl"] == "moe_ops":
            assert float(d["graph_us"]) > 0 and float(d["floor_fraction"]) > 0, d
        if d["status"] != "ok":
            assert d["note"] and d["best_us"] == "", d


def test_tiny_plot_writes_png(tiny_run):
    if not HAS_MATPLOTLIB:
        pytest.skip("matplotlib not installed (pip install 'moe_ops[bench]'): --plot not run")
    _, out = tiny_run
    data = (out / "bench.png").read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 10_000, len(data)


def test_plot_without_matplotlib_is_refused_before_benchmarking(tmp_path):
    png = tmp_path / "never.png"
    code = ("import runpy, sys; sys.modules['matplotlib'] = None; "   # import matplotlib fails
            "sys.argv[0] = 'moe_ops.bench'; runpy.run_module('moe_ops.bench', run_name='__main__')")
    r = _run(["--tiny", "--shapes", SHAPE, "--tokens", "1", "--plot", str(png)], code=code)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "--plot needs matplotlib: pip install matplotlib" in r.stderr
    assert "ceilings" not in r.stdout and not png.exists()


def test_output_directory_is_checked_before_benchmarking(tmp_path):
    r = _run(["--tiny", "--csv", str(tmp_path / "missing" / "out.csv")])
    assert r.returncode == 2 and "--csv" in r.stderr and "no such directory" in r.stderr, r.stderr
    assert "ceilings" not in r.stdout


@pytest.mark.parametrize("module,args,message", [
    ("moe_ops.tools.bench", ["--csv", "{tmp}"], "--csv {tmp}: is a directory"),
    ("moe_ops.tools.bench", ["--md", "{tmp}"], "--md {tmp}: is a directory"),
    ("moe_ops.tools.bench", ["--plot", "{tmp}/x.txt"], "the file type must be one of"),
    ("bench_train", ["--md", "{tmp}/missing/x.md"], "no such directory"),
    ("bench_train", ["--csv", "{tmp}"], "--csv {tmp}: is a directory"),
    ("bench_train", ["--rep-ms", "0"], "--rep-ms must be > 0"),
    ("moe_ops.tools.tune", ["--out-dir", "{tmp}/afile"], "exists and is not a directory"),
])
def test_cli_output_paths_checked_before_the_run(module, args, message, tmp_path, capsys,
                                                 monkeypatch):
    """Output paths that could only fail when the results are written (a directory given as
    a file, an unknown plot type, a file given as the table directory) are usage errors at
    once, before a run of minutes or hours."""
    (tmp_path / "afile").write_text("")
    args = [a.format(tmp=tmp_path) for a in args]
    if module == "moe_ops.tools.bench":
        pytest.importorskip("matplotlib") if "--plot" in args else None
        from moe_ops.tools import bench as mod
        call = lambda: mod.parse_args(["--tiny"] + args)   # noqa: E731
    elif module == "bench_train":
        mod = _import_benchmark_script("bench_train.py", monkeypatch)
        call = lambda: mod.parse_args(["--tiny"] + args)   # noqa: E731
    else:
        from moe_ops.tools import tune as mod
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        call = lambda: mod.main(["--device", "cpu", "--shape", "16,16,4,2", "--tokens", "1"]  # noqa
                                + args)
    with pytest.raises(SystemExit) as exc:
        call()
    assert exc.value.code == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err


@pytest.mark.parametrize("module,args,message", [
    ("bench", ["--tiny", "--tokens", "0"], "a token count must be >= 1, got 0"),
    ("bench", ["--tiny", "--device", "foo"], "--device foo: not a device"),
    ("bench", ["--tiny", "--rep-ms", "0"], "--rep-ms must be > 0"),
    ("bench", ["--tiny", "--weights", "int4"], "invalid choice: 'int4'"),
    ("bench", ["--tiny", "--weights", "fp8", "--impls", "hf_eager"],
     "--impls hf_eager: not an implementation of --weights fp8"),
    ("bench", ["--tiny", "--impls", "deq_moe_ops"],
     "--impls deq_moe_ops: not an implementation of --weights bf16"),
    ("tune", ["--shape", "a,b,c,d", "--tokens", "1"], "--shape a,b,c,d: expected four ints"),
    ("tune", ["--shape", "64,32,8,9", "--tokens", "1"], "K <= E"),
    ("tune", ["--shape", "64,32,8,2", "--tokens", "-3"], "a token count must be >= 1"),
    ("compile_check", ["--tokens", "-5"], "a token count must be >= 1, got -5"),
    ("compile_check", ["--tokens", "1", "--dump", "/proc/no/such/dir"], "--dump /proc/no/such/dir"),
])
def test_cli_bad_arguments_are_usage_errors(module, args, message, capsys, monkeypatch):
    """Bad arguments end in argparse's usage error (exit 2) naming the argument, before any
    work, never in a traceback from inside a run."""
    import importlib

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    mod = importlib.import_module(f"moe_ops.tools.{module}")
    with pytest.raises(SystemExit) as exc:
        mod.parse_args(args) if module == "bench" else mod.main(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_compile_check_refuses_the_interpreter(capsys, monkeypatch):
    from moe_ops.tools import compile_check

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit) as exc:
        compile_check.main(["--shapes", "olmoe", "--tokens", "1"])
    assert exc.value.code == 2 and "unset TRITON_INTERPRET" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-only message")
@pytest.mark.parametrize("module", ["bench", "tune"])
def test_cli_cuda_without_cuda(module, capsys):
    import importlib

    mod = importlib.import_module(f"moe_ops.tools.{module}")
    args = ["--device", "cuda"] + (["--tiny"] if module == "bench" else ["--shape", "64,32,8,2"])
    with pytest.raises(SystemExit) as exc:
        mod.parse_args(args) if module == "bench" else mod.main(args)
    assert exc.value.code == 2 and "no CUDA device here" in capsys.readouterr().err


@pytest.mark.parametrize("script,args,message", [
    ("quickstart.py", ["--tokens", "0"], "--tokens must be >= 1"),
    ("train_moe.py", ["--steps", "0"], "--steps must be >= 1"),
    ("train_moe.py", ["--branching", "0"], "--branching must be >= 1"),
    ("hf_mixtral.py", ["--layers", "0"], "--layers must be >= 1"),
    ("cuda_graph_decode.py", ["--prompt-len", "0"], "--prompt-len must be >= 1"),
    ("quickstart.py", ["--device", "foo"], "invalid choice: 'foo'"),
    ("cuda_graph_decode.py", ["--device", "foo"], "invalid choice: 'foo'"),
])
def test_examples_reject_zero_counts(script, args, message, monkeypatch, capsys):
    """An explicit 0 is a usage error, not a silent fall-back to the default (the examples
    read `args.x or default`). Run in this process (runpy, as `python examples/<script>`
    would): the usage error comes from argument parsing, before any model is built."""
    import runpy

    monkeypatch.setattr(sys, "argv", [str(ROOT / "examples" / script)] + args)
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(ROOT / "examples" / script), run_name="__main__")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err, (exc.value.code, err[-500:])


@pytest.mark.parametrize("script,args,expected", [
    ("hf_mixtral.py", ["--new-tokens", "4", "--prompt-len", "8", "--repeats", "1"],
     "apply_moe_ops (route + dispatch)   tokens identical"),
    ("quickstart.py", [], "relative error vs plain PyTorch"),
    ("train_moe.py", ["--steps", "20"], "PASS: every loss of the first 20 steps"),
    ("cuda_graph_decode.py", ["--new-tokens", "4"], "tokens, transformers vs moe_ops: OK"),
])
def test_examples_run_on_cpu(script, args, expected):
    """The examples (README's first command runs hf_mixtral.py) run to the end on the CPU
    with tiny sizes, and their own checks pass (each exits non-zero on a mismatch)."""
    r = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--device", "cpu"] + args,
                       env=env_without_interpreter(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and expected in r.stdout, (r.returncode, r.stdout[-800:],
                                                        r.stderr[-800:])


def test_cell_inputs_match_the_bench_recipe(monkeypatch):
    """bench.cell_inputs ('shape:T', used by the benchmarks/ scripts) makes what the bench's
    own steps make: weights seed 0, tokens seed 1, the shape's routing; given weights, reuses
    them."""
    import dataclasses

    import torch

    tiny = dataclasses.replace(bench.SHAPES["qwen3_30b_a3b_zipf"], H=32, I=16)
    monkeypatch.setitem(bench.SHAPES, "tiny", tiny)
    c = bench.cell_inputs("tiny:5", "cpu", torch.float32)
    wt = bench.make_weights(tiny, "cpu", torch.float32, seed=0)
    hidden, logits = bench.make_tokens(tiny, wt, 5, "cpu", torch.float32, seed=1)
    tw, ids = bench.route(tiny, logits, wt.bias)
    assert (c.name, c.T, c.shape) == ("tiny", 5, tiny)
    assert torch.equal(c.weights.w13, wt.w13) and torch.equal(c.hidden, hidden)
    assert torch.equal(c.topk_weights, tw) and torch.equal(c.topk_ids, ids)
    assert bench.cell_inputs("tiny:3", "cpu", torch.float32, c.weights).weights is c.weights


def _cell(T, floor_us, **results):
    return bench.Cell("s", T, floor_us, 0, 0, 1, 1.0, None, None, True,
                      {n: bench.Result("s", T, n, **kw) for n, kw in results.items()})


def test_roofline_series_uses_the_best_time_and_leaves_gaps():
    cells = [
        _cell(1, 10.0, moe_ops=dict(eager_us=40.0, graph_us=20.0),
              expert_loop=dict(status="skip", note="budget"), hf_eager=dict(status="n/a")),
        _cell(8, 30.0, moe_ops=dict(status="FAIL", eager_us=30.0),
              expert_loop=dict(eager_us=60.0), hf_eager=dict(status="n/a")),
        _cell(32, 50.0, moe_ops=dict(eager_us=100.0), expert_loop=dict(status="ERR"),
              hf_eager=dict(status="n/a")),
    ]
    series = bench.roofline_series(cells, ["moe_ops", "expert_loop", "hf_eager"])
    assert list(series) == ["s"] and list(series["s"]) == ["moe_ops", "expert_loop"]
    Ts, mo = series["s"]["moe_ops"]
    assert Ts == [1, 8, 32] and mo[0] == 0.5 and math.isnan(mo[1]) and mo[2] == 0.5
    _, loop = series["s"]["expert_loop"]
    assert math.isnan(loop[0]) and loop[1] == 0.5 and math.isnan(loop[2])


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")))
def test_benchmark_scripts_import(script, monkeypatch):
    """The GPU-only scripts under benchmarks/ are not run here, but they must import against
    the current package (a renamed helper shows up in CI, not on the next GPU run). Modules
    whose name starts with "_" are the scripts' shared helpers, not scripts."""
    mod = _import_benchmark_script(script, monkeypatch)
    if not script.startswith("_"):
        assert callable(getattr(mod, "main", None)), script


def _import_benchmark_script(script, monkeypatch):
    """benchmarks/<script> imported as a module (benchmarks/ is not a package)."""
    name = f"bench_script_{script[:-3]}"
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / script)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)   # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_run_gpu_script_parses():
    """benchmarks/run_gpu.sh only runs on the GPU machine: at least its syntax is checked here."""
    r = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "run_gpu.sh")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


