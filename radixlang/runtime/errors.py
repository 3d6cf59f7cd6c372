"""RequestError: a request the caller got wrong. Raised where validation happens.

It is the one exception the HTTP layer answers with a 400 (naming ``param``, the request
field at fault); any other exception is a server fault: a 500 and a log line.
"""
from __future__ import annotations


class RequestError(ValueError):
    """A bad request; ``param`` names the request field at fault, when one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
