"""Triton kernels: paged attention (split-KV decode grouped over the query heads of a KV head, and
prefix+causal extend) and the fused-MoE grouped GEMM.

Importing these modules imports triton (``precision`` excepted); their users import them lazily.
"""
