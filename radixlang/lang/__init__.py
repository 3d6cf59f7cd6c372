"""The DSL frontend: programs -> requests. Never imports torch."""
from __future__ import annotations

from radixlang.lang._public import *  # noqa: F401,F403
from radixlang.lang._public import __all__  # noqa: F401
