"""The sampler against brute-force computations on small logits: top-k, top-p, min-p, the three
penalties, per-request seeds, and the EOS ban before min_new_tokens."""
from __future__ import annotations

import math

import pytest
import torch

from radixlang.runtime.sampling.sampler import SamplingInfo, sample
from radixlang.runtime.sampling.sampling_params import SamplingParams

VOCAB = 8


def info(params: list[SamplingParams], output_ids: list[list[int]] | None = None,
         blocked: list[list[int]] | None = None) -> SamplingInfo:
    n = len(params)
    return SamplingInfo(params=params, output_ids=output_ids or [[] for _ in range(n)],
                        min_tokens_blocked=blocked or [[] for _ in range(n)])


def small_logits(seed: int, rows: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g, dtype=torch.float32) * 1.5


def brute_force_distribution(logits: list[float], *, temperature: float, top_k: int, top_p: float,
                             min_p: float) -> list[float]:
    """The distribution the sampler should draw from, in plain Python: softmax at the temperature,
    then keep tokens by descending probability while the mass before them is < top_p, their rank
    is < top_k and their probability is >= min_p times the largest; renormalize."""
    z = [x / temperature for x in logits]
    m = max(z)
    e = [math.exp(x - m) for x in z]
    probs = [x / sum(e) for x in e]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = [], 0.0
    for rank, i in enumerate(order):
        if mass >= top_p or (top_k > 0 and rank >= top_k) or probs[i] < min_p * probs[order[0]]:
            break
        kept.append(i)
        mass += probs[i]
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(probs))]


def empirical(logits: torch.Tensor, params: SamplingParams, draws: int = 4000) -> list[float]:
    rows = logits.repeat(draws, 1)
    picks = sample(rows, info([params] * draws), torch.Generator().manual_seed(1))
    counts = torch.bincount(picks, minlength=VOCAB).tolist()
    return [c / draws for c in counts]


def test_top_k_1_is_argmax_whatever_the_temperature_and_batch():
    logits = small_logits(0, rows=6)
    params = [SamplingParams(top_k=1, temperature=t) for t in (0.5, 1.0, 2.0)] + \
             [SamplingParams(temperature=1.0, sampling_seed=s) for s in range(3)]
    out = sample(logits.clone(), info(params), torch.Generator().manual_seed(0))
    assert out[:3].tolist() == torch.argmax(logits[:3], dim=-1).tolist()
    alone = sample(logits[:3].clone(), info(params[:3]), torch.Generator().manual_seed(5))
    assert alone.tolist() == out[:3].tolist()


@pytest.mark.parametrize("cut", [
    {"top_p": 0.5}, {"top_p": 0.8}, {"top_p": 0.95}, {"top_k": 3}, {"min_p": 0.2}, {"min_p": 0.05},
    {"top_p": 0.9, "top_k": 2}, {"top_p": 0.9, "min_p": 0.3}, {"temperature": 0.7, "top_p": 0.8},
    {"temperature": 1.8, "min_p": 0.3}, {"temperature": 1.0},
])
def test_top_p_top_k_min_p_cut_exactly_the_brute_force_mass(cut):
    logits = small_logits(3)
    params = SamplingParams(**{"temperature": 1.0, **cut})
    want = brute_force_distribution(logits[0].tolist(), temperature=params.temperature, top_k=params.top_k,
                                    top_p=params.top_p, min_p=params.min_p)
    got = empirical(logits, params)
    support = {i for i, p in enumerate(want) if p > 0}
    assert {i for i, p in enumerate(got) if p > 0} == support  # never a token outside the cut
    assert len(support) < VOCAB or cut == {"temperature": 1.0}  # each case (but the last) cuts something
    assert max(abs(a - b) for a, b in zip(got, want)) < 0.035  # 4000 draws: ~4 standard errors


def test_the_first_token_survives_any_cut():
    logits = torch.tensor([[5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=1.0, top_p=0.01, min_p=1.0)
    assert set(empirical(logits, params, draws=200)) == {1.0, 0.0}
    assert empirical(logits, params, draws=200)[0] == 1.0


def _penalized(logits: torch.Tensor, params: SamplingParams, output_ids: list[int]) -> torch.Tensor:
    """The logits after sample() (which applies the penalties in place), for a greedy row."""
    out = logits.clone()
    sample(out, info([params], [output_ids]))
    return out


@pytest.mark.parametrize("name,value", [("repetition_penalty", 1.5), ("repetition_penalty", 0.6),
                                        ("frequency_penalty", 0.7), ("frequency_penalty", -0.4),
                                        ("presence_penalty", 1.2), ("presence_penalty", -0.5)])
def test_each_penalty_changes_logits_by_its_formula(name, value):
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0, 4.0, -0.2]])
    output_ids = [0, 1, 1, 3, 0, 0, 5]  # counts: 0 x3, 1 x2, 3 x1, 5 x1 (a zero logit)
    counts = {t: output_ids.count(t) for t in set(output_ids)}
    params = SamplingParams(temperature=0.0, **{name: value})
    got = _penalized(logits, params, output_ids)[0].tolist()
    for t, x in enumerate(logits[0].tolist()):
        c = counts.get(t, 0)
        if c == 0:
            want = x
        elif name == "repetition_penalty":
            want = x / value if x > 0 else x * value
        elif name == "frequency_penalty":
            want = x - value * c
        else:
            want = x - value
        assert got[t] == pytest.approx(want, abs=1e-6), (t, x, c)


def test_penalties_combine_repetition_first_then_frequency_and_presence():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0, 4.0, -0.2]])
    output_ids = [0, 1, 1, 6]
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    got = _penalized(logits, params, output_ids)[0].tolist()
    assert got[0] == pytest.approx(2.0 / 2 - 0.5 - 0.25)
    assert got[1] == pytest.approx(-1.0 * 2 - 0.5 * 2 - 0.25)
    assert got[6] == pytest.approx(4.0 / 2 - 0.5 - 0.25)
    assert got[2:6] + got[7:] == logits[0, 2:6].tolist() + logits[0, 7:].tolist()


def test_a_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0.0, presence_penalty=1.0)
    assert sample(logits.clone(), info([SamplingParams(temperature=0.0)], [[0]])).tolist() == [0]
    assert sample(logits.clone(), info([params], [[0]])).tolist() == [1]


def _seeded_tokens(row: torch.Tensor, params: SamplingParams, steps: int, others: list[SamplingParams],
                   generator_seed: int) -> list[int]:
    """Draw ``steps`` tokens for one request, each step batched behind ``others`` (random logits)."""
    out: list[int] = []
    gen = torch.Generator().manual_seed(generator_seed)
    for step in range(steps):
        rest = small_logits(100 + step, rows=len(others)) if others else torch.empty(0, VOCAB)
        logits = torch.cat([rest, row[None]])
        ids = [[(step + i) % VOCAB] * step for i in range(len(others))] + [out]
        picks = sample(logits, info(others + [params], [list(x) for x in ids]), gen)
        out.append(int(picks[-1]))
    return out


def test_seeded_draws_do_not_depend_on_the_batch():
    row = torch.zeros(VOCAB)  # uniform: every draw is decided by the seed
    params = SamplingParams(temperature=1.0, sampling_seed=1234)
    alone = _seeded_tokens(row, params, 24, [], generator_seed=0)
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8, top_p=0.7, sampling_seed=7), SamplingParams(temperature=1.3)]
    batched = _seeded_tokens(row, params, 24, others, generator_seed=99)
    assert batched == alone
    assert len(set(alone)) > 3  # the draws vary step to step
    assert _seeded_tokens(row, SamplingParams(temperature=1.0, sampling_seed=4321), 24, [], 0) != alone


def test_unseeded_draws_follow_the_engine_generator():
    row = torch.zeros(1, VOCAB).repeat(16, 1)
    params = [SamplingParams(temperature=1.0)] * 16
    a = sample(row.clone(), info(params), torch.Generator().manual_seed(3))
    b = sample(row.clone(), info(params), torch.Generator().manual_seed(3))
    c = sample(row.clone(), info(params), torch.Generator().manual_seed(4))
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_blocked_tokens_are_never_sampled(temperature):
    eos, stop = 2, 5
    logits = torch.zeros(200, VOCAB)
    logits[:, eos] = 20.0
    logits[:, stop] = 19.0
    params = [SamplingParams(temperature=temperature, min_new_tokens=4, max_new_tokens=8)] * 200
    picks = sample(logits.clone(), info(params, blocked=[[eos, stop]] * 200), torch.Generator().manual_seed(0))
    assert not bool(((picks == eos) | (picks == stop)).any())
    free = sample(logits.clone(), info(params), torch.Generator().manual_seed(0))  # min_new_tokens reached
    assert bool((free == eos).all()) if temperature == 0.0 else bool((free == eos).float().mean() > 0.5)
