"""The launchers' plain-int helpers give Triton's results."""

import triton

from kimi_helix.kernels.launch import cdiv, next_pow2


def test_cdiv_equals_triton():
    for a in range(-70, 300):
        for b in (1, 2, 3, 7, 16, 64, 128):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_next_pow2_equals_triton():
    for n in [*range(0, 5000), 2**20 - 1, 2**20, 2**20 + 1, 2**31]:
        assert next_pow2(n) == triton.next_power_of_2(n), n
