"""The kernels the heuristic picks compile for Hopper (sm_90) on this CPU-only machine
(moe_ops.compile_check: launches captured, compiled with triton.compile for GPUTarget cuda 90):
no GPU run is needed to catch code the interpreter runs but the compiler rejects, shared memory
over the limit, or a prefill GEMM that lost its tensor-core (wgmma) path."""
import pytest
import torch

from moe_ops.tuning.heuristics import heuristic_config, neighbours
from moe_ops.tuning.shapes import SHAPES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def compile_check():
    cc = pytest.importorskip("moe_ops.tools.compile_check")
    try:
        import triton
        import triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        @triton.jit
        def _one(x_ptr, B: tl.constexpr):
            tl.store(x_ptr + tl.arange(0, B), tl.arange(0, B))

        triton.compile(ASTSource(fn=_one, signature={"x_ptr": "*i32", "B": "constexpr"},
                                 constexprs={(1,): 16}),
                       target=GPUTarget("cuda", 90, 128))
    except Exception as exc:   # no NVIDIA backend / ptxas in this Triton
        pytest.skip(f"this Triton cannot compile for sm_90 here: {type(exc).__name__}: {exc}")
    return cc


def _compile_all(cc, launches):
    out = {}
    for launch in launches:
        c = cc.compile_launch(launch)
        assert c.shared <= cc.SHARED_LIMIT, (launch.name, c.shared)
        out.setdefault(launch.name, []).append(c)
    return out


@pytest.mark.parametrize("name,T", [(n, T) for T in (1, 2048) for n in SHAPES]
                         + [("mixtral_8x7b", 8192)])
def test_heuristic_configs_compile(compile_check, name, T, monkeypatch):
    """Forward and backward of the heuristic's bf16 config: every kernel compiles; at 128-row
    blocks the gate+up and down GEMMs issue wgmma and take their weight tiles by TMA, and the
    weight gradients run the persistent kernel (wgmma, TMA copies)."""
    H, I, E, K = SHAPES[name]
    cfg = heuristic_config(T, E, K, H, I, "cuda", torch.bfloat16)
    launches = compile_check.forward_launches((H, I, E, K), 1 if cfg.direct_rows else 16, cfg,
                                              torch.bfloat16, backward=T > 1,
                                              rows_per_expert=T * K / E)
    got = _compile_all(compile_check, launches)
    assert "gate_up_kernel" in got
    if cfg.block_m == 128:
        assert cfg.tma_gate_up_pair and cfg.half_height_tails
        for kname in ("gate_up_kernel", "down_kernel"):
            fwd = got[kname][0]
            assert fwd.wgmma > 0 and fwd.tma > 0, (kname, fwd.wgmma, fwd.tma)
        # the act tiles by TMA too (tma_down_activations): no pointer copies left
        assert cfg.tma_down_activations and got["down_kernel"][0].cp_async == 0
        wg = got.get("weight_grad_persistent_kernel")
        assert wg and all(c.wgmma > 0 and c.tma > 0 for c in wg), sorted(got)
        assert "weight_grad_kernel" not in got
    if T == 1:
        assert cfg.down_combine_fused == ("down_combine_one_token_kernel" in got)
        assert "combine_kernel" not in got   # folded or done by the down kernel's last program


@pytest.mark.parametrize("variant", ["silu_clamp", "silu_clamp_out", "swiglu_softcap", "ungated"])
@pytest.mark.parametrize("T", [1, 2048])
def test_activation_variants_compile(compile_check, variant, T):
    """The clamped and softcapped SwiGLUs and the ungated ReLU-squared form (w3 = w13, one product per step)
    compile for sm_90, forward and backward, at decode and prefill sizes."""
    H, I, E, K = SHAPES["qwen3_30b_a3b"]
    cfg = heuristic_config(T, E, K, H, I, "cuda", torch.bfloat16)
    kw = dict(ungated=True) if variant == "ungated" else dict(activation=variant)
    launches = compile_check.forward_launches((H, I, E, K), 1 if cfg.direct_rows else 16, cfg,
                                              torch.bfloat16, backward=T > 1,
                                              rows_per_expert=T * K / E, **kw)
    got = _compile_all(compile_check, launches)
    assert "gate_up_kernel" in got
    if variant == "ungated":
        gu = [la for la in launches if la.name == "gate_up_kernel"]
        assert gu and all(la.kwargs.get("SAME_W3") for la in gu), "no one-product path"


def test_alignment_paths_compile(compile_check):
    """Every form of the alignment compiles for sm_90 with the switches the heuristics give
    them: the one-launch scan (T*K fits one tile), count + place (two launches) and count +
    column scan + place (T*K large enough that each two-launch program would walk several
    chunks). The forward_launches of the other tests run at 16 tokens, which never reaches the
    third form."""
    H, I, E, K = SHAPES["qwen3_30b_a3b"]
    align = {"scan_kernel", "count_kernel", "place_kernel", "column_scan_kernel",
             "place_columns_kernel"}
    got = set()
    for T in (8, 512, 8192):
        cfg = heuristic_config(T, E, K, H, I, "cuda", torch.bfloat16)
        launches = [la for la in compile_check.forward_launches((H, I, E, K), T, cfg,
                                                                torch.bfloat16)
                    if la.name in align]
        got |= set(_compile_all(compile_check, launches))
    assert got == align, sorted(got)


def test_path_switches_compile(compile_check):
    """The sweep's code-path switches at a prefill size (TMA pair and unpaired, pointer loads,
    half tiles off) and at T == 1 (separate combine, pointer loads) compile; float32 (no TMA,
    32-deep steps) too."""
    H, I, E, K = SHAPES["qwen3_30b_a3b"]
    words = ("tma", "half", "combine")
    for T, dtype in ((2048, torch.bfloat16), (1, torch.bfloat16), (2048, torch.float32)):
        base = heuristic_config(T, E, K, H, I, "cuda", dtype)
        for vname, cfg in neighbours(base, dtype).items():
            if vname != "heuristic" and not any(w in vname for w in words):
                continue
            launches = compile_check.forward_launches((H, I, E, K), 1 if cfg.direct_rows else 16,
                                                      cfg, dtype)
            _compile_all(compile_check, launches)


def test_weight_grad_lpt_compiles(compile_check, monkeypatch):
    """The persistent weight-gradient kernel with the LPT schedule (WeightGradConfig.lpt_schedule: its
    ranking prologue and per-chunk order load sit behind runtime branches) compiles for sm_90
    with the same wgmma and TMA path as the fixed schedule, and the same shared memory."""
    import dataclasses

    import moe_ops.tuning.heuristics as hz

    H, I, E, K = SHAPES["qwen3_30b_a3b"]
    T = 8192
    cfg = heuristic_config(T, E, K, H, I, "cuda", torch.bfloat16)
    orig = hz.backward_config
    got = {}
    for lpt in (False, True):
        monkeypatch.setattr(hz, "backward_config", lambda *a, lpt=lpt, **k: dataclasses.replace(
            orig(*a, **k), weight_grad=dataclasses.replace(orig(*a, **k).weight_grad,
                                                           persistent=True, lpt_schedule=lpt)))
        launches = [la for la in compile_check.forward_launches(
            (H, I, E, K), 16, cfg, torch.bfloat16, backward=True, rows_per_expert=T * K / E)
            if la.name == "weight_grad_persistent_kernel"]
        # dW2, then dW13 in BackwardConfig.x_chunks column chunks (automatic: 2 at this shape)
        assert len(launches) == 3, [la.name for la in launches]
        assert all(la.kwargs.get("LPT") is lpt for la in launches)
        got[lpt] = _compile_all(compile_check, launches)["weight_grad_persistent_kernel"]
    for fixed, lpt in zip(got[False], got[True]):
        assert lpt.wgmma == fixed.wgmma > 0 and lpt.tma == fixed.tma > 0, (lpt, fixed)
        assert lpt.shared == fixed.shared, (lpt.shared, fixed.shared)


QUANT_CASES = [  # fmt, (H, I, E, K), gpt-oss variant
    ("fp8", (7168, 2048, 256, 8), False),    # DeepSeek-V3
    ("fp8", (2048, 768, 128, 8), False),     # Qwen3-30B-A3B
    ("mxfp4", (2880, 2880, 32, 4), True),    # gpt-oss-20b
]


@pytest.mark.parametrize("T", [1, 512, 8192])
@pytest.mark.parametrize("fmt,shape,gpt_oss", QUANT_CASES, ids=lambda v: str(v))
def test_quant_heuristic_configs_compile(compile_check, fmt, shape, gpt_oss, T):
    """The quantized forward's launches with the heuristic's GPU config, compiled for sm_90
    (T = 1, 512, 8192: FP8's transposed 16-row, 64-row and 128-row tiles; MXFP4's stacked,
    64-row and 128-row prefill tiles):
    both expert GEMMs run wgmma and no mma.sync at every T (the one MMA kind that keeps a
    token's output independent of the batch, docs/design.md), fit the shared memory of one
    program, and MXFP4 decodes through the inline-PTX pairs. FP8 launches with programmatic
    dependent launch, MXFP4 without (the heuristics' choice)."""
    launches = compile_check.quant_launches(fmt, shape, T, gpt_oss=gpt_oss)
    got = _compile_all(compile_check, launches)
    for kname in ("quant_gate_up_kernel", "quant_down_kernel"):
        (c,) = got[kname]
        assert c.wgmma > 0 and c.mma == 0, (kname, c.wgmma, c.mma)
        if fmt == "mxfp4":
            assert "mul.rn.bf16x2" in c.ptx, kname
    pdl = {launch.name: launch.kwargs.get("USE_PDL", False) for launch in launches}
    assert pdl["quant_gate_up_kernel"] == pdl["quant_down_kernel"] == (fmt == "fp8")
    assert ("quantize_groups_kernel" in got) == (fmt == "fp8")


@pytest.mark.parametrize("T", [1, 8, 128, 8192])
def test_mxfp4_mma_layout_compiles_to_word_operands(compile_check, T):
    """MXFP4 in the mma layout (moe_ops.mxfp4_layout), the heuristic's config at gpt-oss-20b,
    compiled for sm_90 by the installed Triton: both expert GEMMs run wgmma and no mma.sync, and
    the word decode's operand layout gives each thread whole 4-byte words (its inline asm packs
    four bytes per register and decodes them as one word: a layout that split words would decode
    wrong values, so this is the check that the Triton in use compiles the path as measured)."""
    launches = compile_check.quant_launches("mxfp4", (2880, 2880, 32, 4), T, gpt_oss=True,
                                            mxfp4_layout="mma")
    got = _compile_all(compile_check, launches)
    for kname in ("quant_gate_up_kernel", "quant_down_kernel"):
        (c,) = got[kname]
        assert c.wgmma > 0 and c.mma == 0, (kname, c.wgmma, c.mma)
        words = compile_check.word_operands(c.ttgir)
        assert words and all(words), (kname, words)


def test_word_operands_reads_layouts(compile_check):
    """word_operands accepts a layout whose registers hold whole 4-byte words and refuses ones
    that split a word (narrower per-thread runs, or word bytes spread over lanes)."""
    def ttgir(layout):
        return (f"#l = {layout}\n"
                '%r:2 = tt.elementwise_inline_asm "and.b32 $0, $4, 0x81C081C0;" '
                "{packed_element = 4 : i32} %p : tensor<16x512xi8, #l> -> "
                "tensor<16x512xbf16, #l>, tensor<16x512xbf16, #l>\n")
    good = ("#ttg.linear<{register = [[0, 1], [0, 2], [0, 4], [0, 8]], lane = [[0, 16], "
            "[1, 0]], warp = [[4, 0]], block = []}>")
    split = ("#ttg.linear<{register = [[0, 1], [0, 4], [0, 8], [0, 16]], lane = [[0, 2], "
             "[1, 0]], warp = [[4, 0]], block = []}>")
    assert compile_check.word_operands(ttgir(good)) == [True]
    assert compile_check.word_operands(ttgir(split)) == [False]
    blocked = ("#ttg.blocked<{sizePerThread = [1, %d], threadsPerWarp = [4, 8], "
               "warpsPerCTA = [4, 1], order = [1, 0]}>")
    assert compile_check.word_operands(ttgir(blocked % 16)) == [True]
    assert compile_check.word_operands(ttgir(blocked % 2)) == [False]
    assert compile_check.word_operands("no asm here") == []


@pytest.mark.parametrize("layout", ["plain", "mma"])
@pytest.mark.parametrize("T", [1, 2048])
def test_mxfp4_one_factor_compiles_two_loops(compile_check, T, layout):
    """QuantDispatchConfig.mxfp4_one_factor at gpt-oss-20b, compiled for sm_90: both expert GEMMs
    keep wgmma (no mma.sync), whole-word operands with the mma layout and their asynchronous tile
    copies, and hold two K loops in the default build's shared memory, one multiplication per
    decoded pair in one and two in the other: 1.5 times the default build's packed
    multiplications. With the mma layout and 128-row blocks (T = 2048) the launcher ignores the
    flag: the same build as the default."""
    import dataclasses

    from moe_ops.launch import quant

    shape = (2880, 2880, 32, 4)
    base = quant.quant_dispatch_config(T, 32, 4, 2880, 2880, "mxfp4", 32, "cuda")
    builds = {}
    for one in (False, True):
        cfg = dataclasses.replace(base, mxfp4_one_factor=one)
        launches = compile_check.quant_launches("mxfp4", shape, T, gpt_oss=True, config=cfg,
                                                mxfp4_layout=layout)
        builds[one] = _compile_all(compile_check, launches)
    for kname in ("quant_gate_up_kernel", "quant_down_kernel"):
        (c0,), (c1,) = builds[False][kname], builds[True][kname]
        if layout == "mma" and base.block_m > 16:
            # the launcher keeps the two-factor loop there (not bit-equal on the GPU)
            assert c1.ptx == c0.ptx, kname
            continue
        assert c1.wgmma > 0 and c1.mma == 0, (kname, c1.wgmma, c1.mma)
        assert c1.cp_async >= c0.cp_async > 0, (kname, c0.cp_async, c1.cp_async)
        # the loops run one after the other, so their tile buffers share shared memory (as
        # branches of an if, each had its own: 2x the bytes, fewer programs per SM)
        assert c1.shared == c0.shared, (kname, c0.shared, c1.shared)
        if layout == "mma":
            words = compile_check.word_operands(c1.ttgir)
            assert words and all(words), (kname, words)
        m0, m1 = c0.ptx.count("mul.rn.bf16x2"), c1.ptx.count("mul.rn.bf16x2")
        assert m0 > 0 and 2 * m1 == 3 * m0, (kname, m0, m1)


@pytest.mark.parametrize("fmt,layout,T", [("mxfp4", lay, T) for lay in ("plain", "mma")
                                          for T in (1, 8, 2048)]
                         + [("fp8", "plain", T) for T in (1, 2048)])
def test_quant_wgmma_not_serialized(compile_check, fmt, layout, T):
    """The quantized expert GEMMs (heuristic configs; gpt-oss-20b for MXFP4, DeepSeek-V3 for
    FP8) assemble without ptxas serializing their wgmmas (warning C7515: "wgmma.mma_async
    instructions are serialized"), which made every K step of the MXFP4 kernels wait for each
    wgmma on Triton 3.6 and 3.7.1 until the K loops were told K > 0 (tl.assume)."""
    from moe_ops.launch import quant

    if fmt == "mxfp4":
        shape, bk, gpt_oss = (2880, 2880, 32, 4), 32, True
    else:
        shape, bk, gpt_oss = (7168, 2048, 256, 8), 128, False
    H, I, E, K = shape
    cfg = quant.quant_dispatch_config(T, E, K, H, I, fmt, bk, "cuda", quant_a=fmt == "fp8")
    launches = compile_check.quant_launches(fmt, shape, T, gpt_oss=gpt_oss, config=cfg,
                                            mxfp4_layout=layout)
    seen = 0
    for launch in launches:
        if not launch.name.startswith("quant_"):
            continue
        c = compile_check.compile_launch(launch)
        log = compile_check.ptxas_log(c.ptx)
        if log is None:
            pytest.skip("Triton's ptxas cannot run here")
        assert c.wgmma > 0, launch.name
        assert "serialized" not in log, (launch.name, log[-600:])
        seen += 1
    assert seen == 2


@pytest.mark.parametrize("probe", ["probe_gluon_ws", "probe_gluon_fp8", "probe_gluon_mxfp4"])
def test_gluon_warp_specialised_probes_compile(compile_check, probe, capsys):
    """The Gluon warp-specialised GEMMs of benchmarks/ (TMA and register-decode producer
    partitions feeding wgmma partitions; the FP8 block-scaled form; MXFP4 decode partitions)
    compile for sm_90 on the
    installed Triton, so Gluon API drift between the supported Tritons shows up in CI rather
    than on a GPU run. Each form must have its wgmma, TMA and register-reallocation
    (setmaxnreg) instructions."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / f"{probe}.py"
    spec = importlib.util.spec_from_file_location(probe, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.compile_only() == 0, capsys.readouterr().out
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "compiled" in ln]
    assert len(lines) == 2, lines
    for ln in lines:
        for what in ("wgmma", "tma", "setmaxnreg"):
            count = int(ln.split(f"{what} ")[1].split(",")[0])
            assert count > 0, (what, ln)
