"""Alignment metadata from the Triton kernels equals the torch reference exactly."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import needs_interpreter, spy_kernel_launches
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_ops.launch.alignment import Alignment, align_triton
from moe_ops.ops.samples import make_dispatch_inputs
from moe_ops.reference import align_reference
from moe_ops.reference.alignment import max_padded_rows


def _check(ids, E, block_m):
    al = align_triton(ids, E, block_m)
    s_ref, b_ref, n_ref = align_reference(ids, E, block_m)
    # the backward's weight-gradient kernel finds the valid ends E entries after the padded ends
    assert al.valid_ends.data_ptr() == al.expert_ends.data_ptr() + 4 * E
    # (compared on the CPU: the reference's tensors are CPU tensors for CUDA ids too)
    ids = ids.cpu()
    al = Alignment(*(v.cpu() if isinstance(v, torch.Tensor) else v
                     for v in (al.sorted_slots, al.block_expert, al.num_rows, al.expert_ends,
                               al.block_m, al.valid_ends)))
    n = int(al.num_rows)
    assert n == int(n_ref)
    assert al.max_rows == max_padded_rows(ids.numel(), E, block_m) >= n
    assert torch.equal(al.sorted_slots[:n], s_ref[:n])
    assert torch.equal(al.block_expert, b_ref)
    counts = torch.bincount(ids.reshape(-1).long().clamp(-1, E).add(1), minlength=E + 2)[1:E + 1]
    padded = (counts + block_m - 1) // block_m * block_m
    assert torch.equal(al.expert_ends.long(), padded.cumsum(0))
    assert torch.equal(al.valid_ends.long(), padded.cumsum(0) - padded + counts)
    # every valid slot appears exactly once; padding is the sentinel
    flat = ids.reshape(-1).long()
    valid = ((flat >= 0) & (flat < E)).nonzero().flatten()
    rows = al.sorted_slots[:n].long()
    assert torch.equal(rows[rows < flat.numel()].sort().values, valid)


@pytest.mark.parametrize("routing", ["uniform", "one_expert", "empty_experts", "negative", "skewed"])
@pytest.mark.parametrize("block_m", [16, 64])
def test_alignment_exact(interpreter, routing, block_m):
    *_, ids = make_dispatch_inputs(37, 4, 4, 12, 3, routing=routing)
    _check(ids, 12, block_m)


@pytest.mark.parametrize("variant", ["two_launch_tri", "two_launch_cumsum", "columns"])
def test_alignment_many_programs(interpreter, variant, constrain):
    """Every multi-program variant gives the reference's table exactly: the two-launch path
    with triangular in-chunk ranks and with cumulative sums, and the three-launch path (count,
    column scan, place; the default for large T*K, with ~one chunk per program and up to 4096
    programs, too slow to interpret here) with 40 programs of several chunks each and a column
    scan of several steps."""
    if variant in ("two_launch_tri", "two_launch_cumsum"):
        constrain(columns_min_chunks=1 << 30,
                   triangular_rank=variant == "two_launch_tri")
    if variant == "columns":
        constrain(columns_min_chunks=1, max_column_programs=40,
                   column_scan_block=16)
    # enough slots for several count/scatter programs, each walking several chunks (two
    # launches: 63 programs of 4 chunks; columns: 36 programs of 7)
    ids = torch.randint(-1, 256, (1000, 8), dtype=torch.int32)
    _check(ids, 256, 16)
    ids = torch.randint(0, 8, (4000, 2), dtype=torch.int64)
    _check(ids, 8, 128)
    # 256 experts, 128-row blocks: each place program writes more than one group of table
    # blocks (8 per group; 348 blocks over 16 programs in the two-launch form, whose program
    # count is capped here so that the interpreter need not walk 40000 slots to get there, and
    # over 38 programs in the columns form); skewed so that many tail blocks and empty experts
    # occur
    if variant == "two_launch_cumsum":   # (the two-launch default at E < 64 only; as above)
        return
    constrain(scan_elems=16 * 256)   # at most 16 two-launch programs
    g = torch.Generator().manual_seed(3)
    hot = torch.randint(0, 256, (1500, 8), generator=g, dtype=torch.int32) % 40
    ids = torch.where(torch.rand(1500, 8, generator=g) < 0.7, hot,
                      torch.randint(-1, 256, (1500, 8), generator=g, dtype=torch.int32))
    _check(ids, 256, 128)


@pytest.mark.parametrize("routing", ["uniform", "one_expert", "empty_experts", "negative", "skewed"])
def test_alignment_scan_several_programs(interpreter, routing, monkeypatch):
    """Decode sizes take the one-launch scan; its programs each write one group of table blocks
    (Qwen3-30B-A3B at T = 8: 64 slots, 128 experts, 16-row blocks: 64 blocks, 4 programs)."""
    import moe_ops.launch.alignment as la

    grids = []
    spy_kernel_launches(monkeypatch, la, lambda kernel, grid, args, kwargs: grids.append(
        (kernel.fn.__name__ if hasattr(kernel, "fn") else "?", grid)))
    *_, ids = make_dispatch_inputs(8, 4, 4, 128, 8, routing=routing)
    _check(ids, 128, 16)
    assert grids == [("scan_kernel", (4,))], grids


@needs_interpreter
@settings(max_examples=40, deadline=None)
@given(T=st.integers(0, 90), E=st.integers(1, 70), block_m=st.sampled_from([16, 32, 128]),
       data=st.data())
def test_alignment_hypothesis(T, E, block_m, data):
    K = data.draw(st.integers(1, E))
    lo = data.draw(st.sampled_from([-1, 0]))
    ids = torch.randint(lo, E + data.draw(st.integers(0, 2)), (T, K), dtype=torch.int32,
                        generator=torch.Generator().manual_seed(data.draw(st.integers(0, 2**31))))
    from moe_ops.tuning import AlignmentConfig, config_constraints

    # half the draws take the three-launch path (count, column scan, place) with few programs
    # and a short scan step, so that spans of several chunks and multi-step scans occur
    switches = {}
    if data.draw(st.booleans()):
        switches = dict(columns_min_chunks=1,
                        max_column_programs=data.draw(st.integers(1, 9)),
                        column_scan_block=data.draw(st.sampled_from([2, 4, 1024])))
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        with config_constraints(AlignmentConfig, **switches):
            _check(ids, E, block_m)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = old


@needs_interpreter
def test_interpreter_set_before_import():
    """TRITON_INTERPRET=1 set before triton is imported (Triton's own convention) works too."""
    code = (
        "import torch, moe_ops\n"
        "from moe_ops.ops.samples import make_dispatch_inputs\n"
        "from moe_ops.reference import dispatch_reference\n"
        "import moe_ops.launch.dispatch as d\n"
        "orig = d.dispatch_triton\n"
        "called = []\n"
        "d.dispatch_triton = lambda *a, **k: called.append(1) or orig(*a, **k)\n"
        "args = make_dispatch_inputs(9, 12, 8, 4, 2, routing='negative')\n"
        "out = torch.ops.moe.dispatch(*args)\n"
        "ref = dispatch_reference(*[a.double() if a.is_floating_point() else a for a in args])\n"
        "assert called and (out.double() - ref).norm() / ref.norm() < 1e-5\n"
        "w, ids = torch.ops.moe.route(torch.randn(5, 8), 2)\n"
        "print('OK')\n")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(Path(__file__).parents[1]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


_GPU_VARIANTS = {
    "default": {},
    "two_launch_tri": dict(columns_min_chunks=1 << 30, triangular_rank=True),
    "two_launch_cumsum": dict(columns_min_chunks=1 << 30, triangular_rank=False),
    "columns_few": dict(columns_min_chunks=1, max_column_programs=40, column_scan_block=16),
}


def _poison_allocator():
    """Fill freed blocks of the caching allocator (large and small pools) with a non-zero byte
    pattern, so that a table entry the kernels fail to write is not accidentally correct."""
    blocks = [torch.full((n,), 0x5A, dtype=torch.uint8, device="cuda")
              for n in (256 << 20, 16 << 20, 1 << 20, 1 << 20, 256 << 10, 64 << 10, 4 << 10)]
    del blocks


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(_GPU_VARIANTS))
@pytest.mark.parametrize("T,E,K,block_m", [
    (8, 128, 8, 16),        # one-launch scan (Qwen3-30B-A3B decode)
    (300, 64, 8, 64),
    (2048, 128, 8, 128),    # three launches by default
    (8192, 256, 8, 128),    # DeepSeek-V3 prefill
    (32768, 8, 2, 128),     # Mixtral: two launches by default
    (70000, 128, 8, 128),   # 560000 slots: the column scan's programs at their 4096 cap
])
@pytest.mark.parametrize("routing", ["uniform", "skewed", "negative", "empty_experts",
                                     "one_expert"])
def test_alignment_exact_gpu(T, E, K, block_m, routing, variant, constrain):
    """On the GPU (compiled kernels, not the interpreter): every form of the alignment gives the
    reference's table exactly, on poisoned memory, at decode and prefill sizes and with skewed,
    negative, empty-expert and one-expert routing."""
    constrain(**_GPU_VARIANTS[variant])
    g = torch.Generator(device="cuda").manual_seed(T * 131 + E)
    *_, ids = make_dispatch_inputs(T, 1, 1, E, K, device="cuda", routing=routing, generator=g)
    _poison_allocator()
    _check(ids, E, block_m)


@pytest.mark.parametrize("n_slots,kernels", [
    (2048, ["count_kernel", "place_kernel"]),
    (2049, ["count_kernel", "column_scan_kernel", "place_columns_kernel"])])
def test_alignment_form_at_the_columns_threshold(interpreter, monkeypatch, n_slots, kernels):
    """Default switches: the three-launch form (count, column scan, place) takes over where the
    two-launch programs would each walk AlignmentConfig.columns_min_chunks (2) chunks or more. 256 experts:
    chunks of 32 slots and at most 64 two-launch programs, so 2048 slots are 64 spans of one
    chunk (two launches) and 2049 slots 33 spans of two chunks (three launches)."""
    import moe_ops.launch.alignment as la

    from moe_ops.launch.alignment import alignment_config

    assert alignment_config().columns_min_chunks == 2
    names = []
    spy_kernel_launches(monkeypatch, la, lambda kernel, grid, args, kwargs: names.append(
        kernel.fn.__name__ if hasattr(kernel, "fn") else "?"))
    ids = torch.randint(-1, 256, (n_slots, 1), dtype=torch.int32,
                        generator=torch.Generator().manual_seed(n_slots))
    _check(ids, 256, 16)
    assert names == kernels, names



@pytest.fixture
def constrain():
    """Sets AlignmentConfig constraints for one test; resets them after it."""
    from moe_ops.tuning import AlignmentConfig, reset_config_constraints, update_config_constraints

    yield lambda **fields: update_config_constraints(AlignmentConfig, **fields)
    reset_config_constraints(AlignmentConfig)
