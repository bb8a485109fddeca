import pytest
import torch

from kimi_helix.engine.sampling import SamplingParams, make_generator, sample


def _logits(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _draws(logits: torch.Tensor, params: SamplingParams, steps: int, seed: int) -> list[int]:
    g = make_generator(seed, "cpu")
    return [int(sample(logits[None], [params], [g])[0]) for _ in range(steps)]


def test_greedy_is_argmax():
    logits = _logits(6, 50)
    logits[2, 7] = logits[2, 11] = logits[2].max() + 1  # a tie: argmax's first index wins
    out = sample(logits, [SamplingParams(temperature=0)] * 6, [None] * 6)
    assert out.dtype == torch.int64 and out.shape == (6,)
    assert torch.equal(out, logits.argmax(-1))
    assert out[2] == 7


def test_mixed_batch_greedy_rows_stay_greedy_and_bf16_is_accepted():
    logits = _logits(4, 30).bfloat16()
    params = [SamplingParams(temperature=0), SamplingParams(seed=1), SamplingParams(temperature=0), SamplingParams()]
    gens = [None, make_generator(1), None, make_generator(2)]
    out = sample(logits, params, gens)
    assert out[0] == logits[0].float().argmax() and out[2] == logits[2].float().argmax()
    assert ((out >= 0) & (out < 30)).all()


def test_seeded_sampling_is_reproducible():
    logits = _logits(1, 100)[0]
    params = SamplingParams(temperature=1.3, top_k=40, top_p=0.9)
    first = _draws(logits, params, 30, seed=123)
    assert first == _draws(logits, params, 30, seed=123)
    assert first != _draws(logits, params, 30, seed=124)
    assert len(set(first)) > 1  # it really samples


@pytest.mark.parametrize("mine", [SamplingParams(temperature=0.8), SamplingParams(temperature=1.5, top_k=5, top_p=0.7)])
def test_draws_do_not_depend_on_batch_neighbours(mine):
    vocab = 64
    target = _logits(1, vocab, seed=9)[0]
    alone = _draws(target, mine, 20, seed=7)

    # Same request, seed and logits, at another position, among neighbours with other settings, seeds and logits;
    # one neighbour shares a generator across two rows.
    shared = make_generator(99)
    neighbours = [
        (SamplingParams(temperature=0), None),
        (SamplingParams(temperature=0.5, top_k=3), make_generator(1)),
        (SamplingParams(top_p=0.5), shared),
        (SamplingParams(top_p=0.5), shared),
    ]
    g = make_generator(7)
    crowded = []
    for step in range(20):
        noise = _logits(len(neighbours), vocab, seed=100 + step)
        logits = torch.cat([noise[:2], target[None], noise[2:]])
        params = [neighbours[0][0], neighbours[1][0], mine, neighbours[2][0], neighbours[3][0]]
        gens = [neighbours[0][1], neighbours[1][1], g, neighbours[2][1], neighbours[3][1]]
        crowded.append(int(sample(logits, params, gens)[2]))
    assert crowded == alone


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = _logits(8, 200, seed=3)
    expected = logits.argmax(-1)
    for params in (SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=2.0, top_p=1e-6)):
        gens = [make_generator(s) for s in range(8)]
        for _ in range(5):
            assert torch.equal(sample(logits, [params] * 8, gens), expected)


# 60,000 draws, judged by the chi-square critical value at p = 1e-4 for the support's degrees of freedom. The seeds
# are fixed, so the test cannot flake; a wrong distribution overshoots by far (T = 0.75 instead of 0.7 scores ~280).
N_DRAWS = 60_000
CHI2_CRITICAL_1E4 = {1: 15.1, 2: 18.4, 3: 21.1, 4: 23.5, 5: 25.7, 6: 27.9, 7: 29.9, 8: 31.8, 9: 33.7}


def _assert_matches(counts: torch.Tensor, probs: torch.Tensor) -> None:
    expected = probs * counts.sum()
    support = expected > 0
    assert counts[~support].sum() == 0, "drew a token of probability 0"
    chi2 = float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())
    assert chi2 < CHI2_CRITICAL_1E4[int(support.sum()) - 1], chi2


def _empirical(logits: torch.Tensor, params: SamplingParams, seed: int) -> torch.Tensor:
    g = make_generator(seed)
    out = sample(logits.expand(N_DRAWS, -1), [params] * N_DRAWS, [g] * N_DRAWS)
    return torch.bincount(out, minlength=logits.shape[-1]).double()


def test_empirical_distribution_matches_softmax_over_temperature():
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0, 3.0, 0.0, 1.5, -0.5, 2.5, 0.2])
    probs = torch.softmax(logits.double() / 0.7, -1)
    counts = _empirical(logits, SamplingParams(temperature=0.7), seed=0)
    _assert_matches(counts, probs)


def test_empirical_distribution_under_top_k_and_top_p():
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0, 3.0, 0.0, 1.5, -0.5, 2.5, 0.2])
    order = logits.argsort(descending=True)

    # top_k = 6: the softmax over the six best, renormalised.
    probs = torch.zeros(10, dtype=torch.float64)
    probs[order[:6]] = torch.softmax(logits[order[:6]].double(), -1)
    counts = _empirical(logits, SamplingParams(top_k=6), seed=1)
    _assert_matches(counts, probs)

    # top_p = 0.8 at T = 1: tokens join, best first, while the mass before them is < 0.8.
    full = torch.softmax(logits.double(), -1)[order]
    n_keep = int(((full.cumsum(0) - full) < 0.8).sum())
    assert 1 < n_keep < 10
    probs = torch.zeros(10, dtype=torch.float64)
    probs[order[:n_keep]] = full[:n_keep] / full[:n_keep].sum()
    counts = _empirical(logits, SamplingParams(top_p=0.8), seed=2)
    _assert_matches(counts, probs)


def test_unseeded_generators_follow_torch_manual_seed():
    torch.manual_seed(5)
    a = [make_generator(None).initial_seed() for _ in range(2)]
    torch.manual_seed(5)
    b = [make_generator(None).initial_seed() for _ in range(2)]
    assert a == b and a[0] != a[1]


def test_stop_accepts_a_string():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", 2.0),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_k", -2),
        ("top_k", 1.5),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", float("nan")),
        ("seed", -1),
        ("seed", "7"),
        ("seed", 2**64),
        ("seed", 1.0),
        ("temperature", float("inf")),
        ("temperature", "0.5"),
        ("max_tokens", True),
        ("stop", [""]),
        ("stop", [1]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", 5),
        ("ignore_eos", 1),
    ],
)
def test_bad_params_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must"):
        SamplingParams(**{field: value})


def test_seed_range_is_torchs():
    for seed in (0, 2**63, 2**64 - 1):  # every seed SamplingParams accepts can seed a generator
        make_generator(SamplingParams(seed=seed).seed)
    with pytest.raises(
        ValueError, match=r"SamplingParams\.seed must be None or an int in \[0, 2\*\*64\), got 18446744073709551616"
    ):
        SamplingParams(seed=2**64)


def test_sample_checks_lengths():
    with pytest.raises(ValueError, match="rows"):
        sample(torch.zeros(2, 5), [SamplingParams()], [None, None])
