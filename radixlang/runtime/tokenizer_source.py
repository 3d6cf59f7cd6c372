"""How a prompt becomes token ids, and which ids end a reply, as the model's own metadata says.

transformers is the reference (docs/models.md): a text prompt gets the special tokens
``tokenizer(text)`` adds (a BOS when the model's tokenizer asks for one: GGUF
``tokenizer.ggml.add_bos_token``, a ``tokenizer.json`` post-processor; an EOS on ``add_eos_token``);
a chat goes through the template, which writes its special tokens itself (Gemma's
``{{ bos_token }}``), so nothing is added to it, as ``apply_chat_template(tokenize=True)`` does.
Every EOS id the model names ends a reply: the config's, ``generation_config.json``'s (a list on
Llama 3 / Gemma 3) and the tokenizer's. ``--chat-template`` names a file or one of the templates shipped
in ``chat_templates/`` (a base model's file carries none).
"""
from __future__ import annotations

import json
import os
from importlib import resources
from typing import Any

BUILTIN_TEMPLATES = ("chatml", "gemma", "llama-3")  # chat_templates/<name>.jinja


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """A text prompt's ids as ``tokenizer(text).input_ids`` gives them, except that a text which already
    starts with the BOS token (a chat template rendered as text, as the DSL sends it) gets no second one:
    llama.cpp warns on that double BOS, and no model is trained on it."""
    ids = list(tokenizer.encode(text))
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
        plain = tokenizer.encode(text, add_special_tokens=False)
        if plain and plain[0] == bos and len(ids) > len(plain):
            ids = ids[1:]
    return ids


def encode_chat(tokenizer: Any, rendered: str) -> list[int]:
    """A chat template's rendered text: the template wrote the special tokens, so none are added."""
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def generation_eos_ids(folder: str) -> list[int]:
    """The EOS ids of the folder's ``generation_config.json`` (an int or a list; none without the file)."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return _ids(json.load(f).get("eos_token_id"))


def merged_eos_ids(config_eos: Any, folder: str) -> int | list[int] | None:
    """The config's ``eos_token_id`` with the generation config's added (order kept, no repeats): an int
    when there is one id, as transformers writes it."""
    ids = list(dict.fromkeys(_ids(config_eos) + generation_eos_ids(folder)))
    if not ids:
        return config_eos
    return ids[0] if len(ids) == 1 else ids


def resolve_chat_template(value: str) -> str:
    """The Jinja text ``--chat-template`` names: a built-in template's name, else a file's path."""
    if value in BUILTIN_TEMPLATES:
        return resources.files("radixlang.runtime").joinpath(f"chat_templates/{value}.jinja").read_text("utf-8")
    with open(value, encoding="utf-8") as f:
        return f.read()


def check_chat_template(value: str) -> None:
    """A ValueError naming the choices unless ``value`` is a built-in template or an existing file."""
    if value not in BUILTIN_TEMPLATES and not os.path.isfile(value):
        raise ValueError(f"chat_template must be a Jinja template file or a built-in template "
                         f"({', '.join(BUILTIN_TEMPLATES)}), got {value!r} (no such file)")
