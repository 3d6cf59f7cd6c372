"""Sampling: ``SamplingParams`` (validated, torch-free, shared with the DSL's wire names), the batched
sampler with logprobs, and a step's plan and output with what a runner does with them (``step_io``,
``step_sampler``). Imports torch, the stdlib and the kernels' token bitmasks."""
