"""Host-side helpers of moe_ops._runtime (the launchers size grids and blocks with them)."""
import triton

from moe_ops._runtime import cdiv, next_pow2


def test_cdiv_matches_triton():
    for a in range(0, 3000, 7):
        for b in (1, 2, 3, 16, 64, 127, 128, 1024):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    assert cdiv(2**40 + 1, 2**20) == 2**20 + 1


def test_next_pow2_matches_triton():
    for n in range(1, 70000):
        assert next_pow2(n) == triton.next_power_of_2(n), n
    assert next_pow2(0) == 1   # a block size: never 0 (triton.next_power_of_2(0) is 0)
    assert next_pow2(2**33 + 1) == 2**34
