"""Sampling: ``SamplingParams`` (validated, torch-free, shared with the DSL's wire names)
and the batched sampler with logprobs. Imports only torch and the stdlib."""
