"""How `select` turns per-choice token logprobs into a decision.

Every method is called with keyword arguments only:
  choices: the candidate strings;
  normalized_prompt_logprobs: per choice, the mean logprob of its tokens;
  input_token_logprobs: per choice, [(logprob, token_id, text | None), ...] for the
    choice's own tokens, conditioned on the prompt;
  output_token_logprobs: per choice, the (empty) output logprobs;
  unconditional_token_logprobs: per choice, the same tokens scored without the
    prompt (only for methods with requires_unconditional_logprobs).
A logprob of None (the first position of a sequence) counts as 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

LogprobRow = Sequence[Any]  # (logprob | None, token_id, text | None)


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


def normalized_logprob(row: Sequence[LogprobRow]) -> float:
    """Mean logprob over the tokens that have one; 0.0 for an empty row."""
    values = [float(t[0]) for t in row if t[0] is not None]
    return sum(values) / len(values) if values else 0.0


def _argmax(values: Sequence[float]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def _check(choices: Sequence[str], rows: Sequence[Sequence[LogprobRow]]) -> None:
    if not choices:
        raise ValueError("select needs at least one choice, got none")
    if len(rows) != len(choices):
        raise ValueError(f"expected one logprob row per choice ({len(choices)}), got {len(rows)}")


class ChoicesSamplingMethod:
    requires_unconditional_logprobs: bool = False

    def __call__(self, *, choices: Sequence[str], normalized_prompt_logprobs: Sequence[float],
                 input_token_logprobs: Sequence[Sequence[LogprobRow]],
                 output_token_logprobs: Sequence[Sequence[LogprobRow]],
                 unconditional_token_logprobs: Sequence[Sequence[LogprobRow]] | None = None) -> ChoicesDecision:
        raise NotImplementedError

    def __repr__(self) -> str:
        return type(self).__name__


def _base_meta(normalized, input_rows, output_rows) -> dict[str, Any]:
    return {"normalized_prompt_logprobs": list(normalized), "input_token_logprobs": [list(r) for r in input_rows],
            "output_token_logprobs": [list(r) for r in output_rows]}


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean token logprob (SGLang's default)."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        _check(choices, input_token_logprobs)
        best = _argmax(normalized_prompt_logprobs)
        return ChoicesDecision(choices[best], _base_meta(normalized_prompt_logprobs, input_token_logprobs,
                                                          output_token_logprobs))


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Compare choices token by token, keeping those with the best logprob at each position.

    A shorter choice is padded with its own mean logprob so that it can compete
    with longer choices that extend it.
    """

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        _check(choices, input_token_logprobs)
        width = max(len(r) for r in input_token_logprobs)
        matrix = []
        for row in input_token_logprobs:
            values = [0.0 if t[0] is None else float(t[0]) for t in row]
            mean = sum(values) / len(values) if values else 0.0
            matrix.append(values + [mean] * (width - len(values)))
        remaining = list(range(len(choices)))
        for j in range(width):
            top = max(matrix[i][j] for i in remaining)
            remaining = [i for i in remaining if matrix[i][j] == top]
            if len(remaining) == 1:
                break
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["greedy_logprob_matrix"] = matrix
        return ChoicesDecision(choices[remaining[0]], meta)


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean of (conditional - unconditional) token logprobs (Brown et al., 2020)."""
    requires_unconditional_logprobs = True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        _check(choices, input_token_logprobs)
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional_token_logprobs, got None")
        scores = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            if len(cond) != len(uncond):
                raise ValueError(f"expected conditional and unconditional rows of equal length, "
                                 f"got {len(cond)} and {len(uncond)}")
            diffs = [(0.0 if c[0] is None else float(c[0])) - (0.0 if u[0] is None else float(u[0]))
                     for c, u in zip(cond, uncond)]
            scores.append(sum(diffs) / len(diffs) if diffs else 0.0)
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["unconditional_token_logprobs"] = [list(r) for r in unconditional_token_logprobs]
        meta["normalized_unconditional_prompt_logprobs"] = scores
        return ChoicesDecision(choices[_argmax(scores)], meta)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()


def decide(method: ChoicesSamplingMethod, choices: Sequence[str], input_rows: Sequence[Sequence[LogprobRow]],
           unconditional_rows: Sequence[Sequence[LogprobRow]] | None = None) -> ChoicesDecision:
    """Run a method on per-choice rows that cover exactly each choice's tokens."""
    return method(choices=list(choices), normalized_prompt_logprobs=[normalized_logprob(r) for r in input_rows],
                  input_token_logprobs=input_rows, output_token_logprobs=[[] for _ in choices],
                  unconditional_token_logprobs=unconditional_rows)
