"""The public LSE combine op against attention over the concatenated keys (float64), its Triton kernel against the
reference, the zero-KV identity and the negative control: without sanitising, empty-rank rows break the combine."""

import pytest
import torch

from kimi_helix.kernels.mla import combine_partials, combine_partials_ref, sanitize_empty


def _partials(s: int, n: int, d: int, keys_per_part: torch.Tensor, seed: int = 0):
    """Per part, attention of n rows over its own random keys (rows with 0 keys: garbage, as a kernel that
    divides by a zero sum gives); plus the float64 attention over all parts' keys."""
    g = torch.Generator().manual_seed(seed)
    # keys_per_part [S, N]: part s gives row i keys_per_part[s, i] keys (a mask over one pool of keys per part).
    max_k = int(keys_per_part.max())
    pool_s = torch.randn(s, n, max_k, generator=g, dtype=torch.float64) * 3
    pool_v = torch.randn(s, max_k, d, generator=g, dtype=torch.float64)
    visible = torch.arange(max_k)[None, None, :] < keys_per_part[..., None]
    masked = pool_s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(masked, dim=-1)  # [S, N]
    out = torch.einsum("snk,skd->snd", torch.softmax(masked, dim=-1), pool_v)  # NaN rows where no key
    empty = keys_per_part == 0
    out = out.masked_fill(empty[..., None], float("nan"))
    lse = lse.masked_fill(empty, 1e4)  # poisoned statistics, as TensorRT-LLM's zero-KV test uses
    all_s = masked.permute(1, 0, 2).reshape(n, -1)
    all_v = pool_v[:, None].expand(s, n, max_k, d).permute(1, 0, 2, 3).reshape(n, -1, d)
    probs = torch.softmax(all_s, dim=-1).nan_to_num(0.0)
    ref = torch.einsum("nk,nkd->nd", probs, all_v)
    return out.float(), lse.float(), ref, ~empty


def test_combine_is_exact_with_empty_parts_sanitised():
    s, n, d = 4, 24, 16
    keys = torch.randint(0, 5, (s, n), generator=torch.Generator().manual_seed(1))
    keys[:, 0] = 0  # a row no part has keys for: the all-empty guard
    keys[:, 1] = torch.tensor([3, 0, 0, 0])  # a single contributor
    out, lse, ref, has = _partials(s, n, d, keys)
    assert (has.sum(0) > 1).any()  # many rows have several contributors, so weights are not all 1
    clean_out, clean_lse = sanitize_empty(out, lse, has)
    got, got_lse = combine_partials_ref(clean_out, clean_lse)
    assert torch.isfinite(got).all()
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-6)
    assert got_lse[0] == float("-inf") and (got[0] == 0).all()
    assert torch.isfinite(got_lse[1:]).all()


def test_negative_control_without_sanitising_is_wrong():
    s, n, d = 3, 16, 8
    keys = torch.randint(0, 4, (s, n), generator=torch.Generator().manual_seed(2))
    keys[0, :] = 0  # part 0 has no keys for any row
    keys[1:, :] = keys[1:, :].clamp_min(1)
    out, lse, ref, _ = _partials(s, n, d, keys)
    got, _ = combine_partials_ref(out, lse)
    wrong = ~torch.isfinite(got) | ((got.double() - ref).abs() > 1e-2)
    assert wrong.all(dim=-1).all(), "withholding the zero-KV sanitising must corrupt every row part 0 poisons"


@pytest.mark.parametrize("s,n,d", [(1, 5, 16), (3, 33, 32), (4, 16, 64)])
def test_triton_combine_matches_reference(s, n, d):
    keys = torch.randint(0, 4, (s, n), generator=torch.Generator().manual_seed(s + n))
    keys[:, -1] = 0
    out, lse, _, has = _partials(s, n, d, keys, seed=3)
    out, lse = sanitize_empty(out, lse, has)
    want, want_lse = combine_partials(out, lse, backend="torch")
    got, got_lse = combine_partials(out, lse, backend="triton")
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(torch.isinf(got_lse), torch.isinf(want_lse))
    fin = torch.isfinite(want_lse)
    assert torch.allclose(got_lse[fin], want_lse[fin], rtol=1e-5, atol=1e-6)


def test_combine_rejects_bad_shapes():
    with pytest.raises(ValueError, match="disagree"):
        combine_partials(torch.zeros(2, 3, 4), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="backend"):
        combine_partials(torch.zeros(2, 3, 4), torch.zeros(2, 3), backend="cuda")
