"""What `import radixlang` re-exports (radixlang/__init__.py does `from radixlang.lang._public import *`).

Names follow `import sglang as sgl`, so programs written for SGLang run unchanged.
Nothing here imports torch; Engine is added lazily by radixlang/__init__.py.
"""
from __future__ import annotations

from radixlang.lang.api import (assistant, assistant_begin, assistant_end, flush_cache, function, gen, gen_int,
                                gen_string, get_default_backend, get_server_info, select, separate_reasoning,
                                set_default_backend,
                                system, system_begin, system_end, user, user_begin, user_end)
from radixlang.lang.backends.base import Backend
from radixlang.lang.backends.engine import EngineBackend
from radixlang.lang.backends.openai import OpenAI
from radixlang.lang.backends.runtime import Runtime
from radixlang.lang.backends.runtime_endpoint import RuntimeEndpoint
from radixlang.lang.chat_template import ChatTemplate, get_chat_template
from radixlang.lang.choices import (ChoicesDecision, ChoicesSamplingMethod, greedy_token_selection,
                                    token_length_normalized, unconditional_likelihood_normalized)
from radixlang.lang.program import Function
from radixlang.lang.state import ProgramState, ProgramStateGroup

__all__ = [
    "function", "Function", "gen", "gen_int", "gen_string", "select", "separate_reasoning",
    "system", "user", "assistant", "system_begin", "system_end", "user_begin", "user_end",
    "assistant_begin", "assistant_end",
    "set_default_backend", "get_default_backend", "flush_cache", "get_server_info",
    "Backend", "EngineBackend", "RuntimeEndpoint", "Runtime", "OpenAI",
    "ChatTemplate", "get_chat_template", "ProgramState", "ProgramStateGroup",
    "ChoicesDecision", "ChoicesSamplingMethod",
    "token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized",
]
