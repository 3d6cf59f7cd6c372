"""The one error type of constrained/ that names the request field at fault.

constrained/ never imports the runtime; the scheduler turns a ValueError with a
``param`` attribute into the request's 400 (RequestError does the same upstream).
"""

from __future__ import annotations


class UnsupportedGrammar(ValueError):
    """A grammar (kind, keyword, format ...) the chosen backend cannot enforce; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param
