"""Backends: what a program runs on (in-process Engine, HTTP endpoint, launched Runtime, OpenAI)."""
