"""The three choice methods on hand-computed logprob rows."""
from __future__ import annotations

import pytest

from radixlang.lang.choices import (decide, greedy_token_selection, normalized_logprob, token_length_normalized,
                                    unconditional_likelihood_normalized)


def rows(*lists):
    return [[(lp, i, None) for i, lp in enumerate(values)] for values in lists]


def test_normalized_logprob_skips_none():
    assert normalized_logprob([(None, 1, None), (-1.0, 2, None), (-3.0, 3, None)]) == -2.0
    assert normalized_logprob([]) == 0.0


def test_token_length_normalized_prefers_best_mean_not_best_sum():
    # sums: -2.0 vs -3.0 ; means: -2.0 vs -1.0 -> the longer choice wins
    d = decide(token_length_normalized, ["a", "bbb"], rows([-2.0], [-1.0, -1.0, -1.0]))
    assert d.decision == "bbb"
    assert d.meta_info["normalized_prompt_logprobs"] == [-2.0, -1.0]
    assert len(d.meta_info["input_token_logprobs"]) == 2


def test_token_length_normalized_tie_takes_first():
    d = decide(token_length_normalized, ["x", "y"], rows([-1.0], [-1.0]))
    assert d.decision == "x"


def test_greedy_token_selection_decides_at_first_differing_token():
    # means favour "b" (-0.6 vs -1.05) but "a" has the better first token
    d = decide(greedy_token_selection, ["a", "b"], rows([-0.1, -2.0], [-0.2, -1.0]))
    assert d.decision == "a"
    assert d.meta_info["greedy_logprob_matrix"] == [[-0.1, -2.0], [-0.2, -1.0]]


def test_greedy_token_selection_pads_short_choice_with_its_mean():
    # "yes" (1 token, -0.5) vs "yes sir" (tokens -0.5, -0.1): at position 1 the short one is padded with -0.5
    d = decide(greedy_token_selection, ["yes", "yes sir"], rows([-0.5], [-0.5, -0.1]))
    assert d.decision == "yes sir"
    assert d.meta_info["greedy_logprob_matrix"][0] == [-0.5, -0.5]
    d = decide(greedy_token_selection, ["yes", "yes sir"], rows([-0.5], [-0.5, -0.9]))
    assert d.decision == "yes"


def test_unconditional_likelihood_normalized_corrects_for_prior():
    cond = rows([-1.0, -1.0], [-0.5, -0.5])
    uncond = rows([-3.0, -3.0], [-0.4, -0.4])  # "b" is likely anyway; "a" gains most from the prompt
    d = decide(unconditional_likelihood_normalized, ["a", "b"], cond, uncond)
    assert d.decision == "a"
    assert d.meta_info["normalized_unconditional_prompt_logprobs"] == pytest.approx([2.0, -0.1])
    # token_length_normalized would pick "b"
    assert decide(token_length_normalized, ["a", "b"], cond).decision == "b"


def test_unconditional_none_counts_as_zero():
    cond = rows([-1.0], [-2.0])
    uncond = [[(None, 0, None)], [(None, 0, None)]]
    assert decide(unconditional_likelihood_normalized, ["a", "b"], cond, uncond).decision == "a"


def test_unconditional_requires_rows():
    assert unconditional_likelihood_normalized.requires_unconditional_logprobs
    assert not token_length_normalized.requires_unconditional_logprobs
    with pytest.raises(ValueError, match="unconditional_token_logprobs"):
        decide(unconditional_likelihood_normalized, ["a"], rows([-1.0]))


def test_row_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="one logprob row per choice"):
        decide(token_length_normalized, ["a", "b"], rows([-1.0]))
