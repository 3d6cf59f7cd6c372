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


def one_line(message: str, limit: int = 300) -> str:
    """A grammar library's error as one line: its first line, and the cause that Rust-style reports
    (llguidance's regex errors) put on a later ``error: ...`` line below a drawing of carets."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    causes = [line.removeprefix("error:").strip() for line in lines[1:] if line.startswith("error:")]
    return " ".join([lines[0], *causes])[:limit]
