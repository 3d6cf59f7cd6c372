"""Entrypoints: the in-process ``Engine``, the server launcher, the HTTP app (native and
OpenAI routes), the OpenAI protocol and serving, Prometheus metrics. May import every
runtime room."""
