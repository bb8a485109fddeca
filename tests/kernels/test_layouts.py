"""`kernels.layouts`: the launch-layout cache evicts the least recently used entry, and `retained()` keeps every
layout handed out inside it, hit or built, so a CUDA graph's layouts outlive their eviction."""

import pytest

from kimi_helix.kernels.layouts import layout_cache, retained


def test_layout_cache_evicts_the_least_recently_used():
    built = []

    @layout_cache(maxsize=2)
    def layout(n):
        built.append(n)
        return [n]

    a = layout(1)
    layout(2)
    assert layout(1) is a  # a hit, now the most recent
    layout(3)  # evicts 2
    assert layout(1) is a and built == [1, 2, 3]
    layout(2)
    assert built == [1, 2, 3, 2]


def test_retained_keeps_what_was_handed_out_inside_it():
    @layout_cache(maxsize=1)
    def layout(n):
        return [n]

    before = layout(0)
    with retained() as outer:
        hit = layout(0)
        with retained() as inner:
            built = layout(1)  # evicts 0 from the cache, not from the lists
    layout(2)
    assert hit is before
    assert [id(v) for v in outer] == [id(hit), id(built)] and [id(v) for v in inner] == [id(built)]
    assert layout(0) is not before  # rebuilt: only the scopes held the old one


def test_layout_cache_needs_a_positive_size():
    with pytest.raises(ValueError, match="maxsize must be >= 1"):
        layout_cache(maxsize=0)
