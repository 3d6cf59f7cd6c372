"""Triton kernels for paged attention: split-KV decode and prefix+causal extend.

Importing this package imports triton; the Triton backend imports it lazily.
"""
