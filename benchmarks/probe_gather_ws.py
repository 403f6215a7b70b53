"""Does this Triton compile a descriptor gather (`desc.gather(rows, k)`, TMA gather on Blackwell)
for sm_90, with and without Hopper warp specialisation? gate+up's A rows are gathered by token,
and Triton's warp-specialisation pass needs its operands loaded through descriptors
(benchmarks/NOTES.md, entries 24-25). Compiles only (no GPU needed):

    python benchmarks/probe_gather_ws.py

Triton 3.9 on the CPU machine (2026-12-01): the plain block load compiles warp-specialised (12
warps); the gather fails in both cases: with WS the data partitioning meets an op it does not
know ("Unexpected op"), without it Triton emits `cp.async.bulk.tensor...tile::gather4`, which
ptxas rejects below sm_100.
"""
import contextlib
import os
import re
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _probe(x_ptr, w_ptr, y_ptr, rows_ptr, M, N, K, n_tiles, BM: tl.constexpr, BN: tl.constexpr,
           BK: tl.constexpr, NP: tl.constexpr, USE_GATHER: tl.constexpr, WS: tl.constexpr):
    pid = tl.program_id(0)
    x_rows = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[1, BK])
    x_block = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    y_desc = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    for tile in tl.range(pid, n_tiles, NP, warp_specialize=WS):
        pm = tile % 8
        pn = tile // 8
        rows = tl.load(rows_ptr + pm * BM + tl.arange(0, BM))
        acc = tl.zeros((BM, BN), tl.float32)
        for k0 in range(0, K, BK):
            if USE_GATHER:
                a = x_rows.gather(rows, k0)
            else:
                a = x_block.load([pm * BM, k0])
            b = w_desc.load([pn * BN, k0])
            acc = tl.dot(a, tl.trans(b), acc)
        y_desc.store([pm * BM, pn * BN], acc.to(tl.bfloat16))


@contextlib.contextmanager
def _captured_output():
    """stdout and stderr of this process, Python's and the C++ passes' (file descriptors 1 and 2),
    into a temporary file whose text is yielded as a one-element list after the block."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    text = [""]
    with tempfile.TemporaryFile(mode="w+") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield text
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            f.seek(0)
            text[0] = f.read()


def main():
    names = ["x_ptr", "w_ptr", "y_ptr", "rows_ptr", "M", "N", "K", "n_tiles"]
    sig = dict(zip(names, ["*bf16", "*bf16", "*bf16", "*i32", "i32", "i32", "i32", "i32"]))
    sig.update({n: "constexpr" for n in ("BM", "BN", "BK", "NP", "USE_GATHER", "WS")})
    aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 5, 6)}
    print(f"triton {triton.__version__}, target sm_90")
    for gather in (False, True):
        for ws in (True, False):
            consts = {(8,): 128, (9,): 128, (10,): 64, (11,): 132, (12,): gather, (13,): ws}
            what = f"{'gather' if gather else 'block load'}, {'WS' if ws else 'no WS'}"
            try:
                with _captured_output() as log:
                    k = triton.compile(ASTSource(fn=_probe, signature=sig, constexprs=consts,
                                                 attrs=aligned),
                                       target=GPUTarget("cuda", 90, 128),
                                       options=dict(num_warps=4, num_stages=3))
                ptx = k.asm["ptx"]
                print(f"  {what:<22} compiles: {k.metadata.num_warps} warps, "
                      f"{ptx.count('wgmma.mma_async')} wgmma, "
                      f"{ptx.count('cp.async.bulk.tensor')} TMA ops")
            except Exception as exc:  # noqa: BLE001 - the answer is the failure
                why = re.findall(r"(Unexpected op|error +: .*|UNREACHABLE[^\n]*)",
                                 log[0] + str(exc))
                print(f"  {what:<22} FAILS: {type(exc).__name__}: "
                      f"{(why[0] if why else str(exc).splitlines()[0])[:150]}")


if __name__ == "__main__":
    main()
