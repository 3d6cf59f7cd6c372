"""Role markers: derived from a tokenizer's Jinja chat template, or a named fallback."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    role_prefix_and_suffix: dict[str, tuple[str, str]]
    default_system_prompt: str | None = None
    stop_str: tuple[str, ...] = ()
    # llama-2 style: a user turn right after the system turn continues the same [INST] block
    user_prefix_after_system: str | None = None

    def get_prefix_and_suffix(self, role: str, history: list[dict[str, str]]) -> tuple[str, str]:
        if role not in self.role_prefix_and_suffix:
            raise ValueError(f"role must be one of {', '.join(self.role_prefix_and_suffix)}, got {role!r}")
        prefix, suffix = self.role_prefix_and_suffix[role]
        if role == "user" and self.user_prefix_after_system is not None and history \
                and history[-1]["role"] == "system":
            prefix = self.user_prefix_after_system
        return prefix, suffix


def _templates() -> dict[str, ChatTemplate]:
    chatml = ChatTemplate("chatml", {r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ROLES},
                          stop_str=("<|im_end|>",))
    llama3 = ChatTemplate("llama-3-instruct",
                          {r: (f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>") for r in ROLES},
                          stop_str=("<|eot_id|>",))
    llama2 = ChatTemplate("llama-2-chat", {"system": ("<s>[INST] <<SYS>>\n", "\n<</SYS>>\n\n"),
                                           "user": ("[INST] ", " [/INST]"), "assistant": ("", " </s><s>")},
                          user_prefix_after_system="")
    default = ChatTemplate("default", {"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"),
                                       "assistant": ("ASSISTANT:", "\n")})
    return {"chatml": chatml, "llama-3-instruct": llama3, "llama-3": llama3, "llama-2-chat": llama2,
            "llama-2": llama2, "default": default}


def get_chat_template(name: str) -> ChatTemplate:
    templates = _templates()
    if name not in templates:
        raise ValueError(f"chat template must be one of {', '.join(sorted(templates))}, got {name!r}")
    return templates[name]


def match_chat_template(model_path: str | None) -> ChatTemplate:
    """A named template guessed from a model path; 'default' when nothing matches."""
    path = (model_path or "").lower()
    if "llama-3" in path or "llama3" in path:
        return get_chat_template("llama-3")
    if "llama-2" in path or "llama2" in path:
        return get_chat_template("llama-2")
    if any(k in path for k in ("qwen", "smollm", "chatml", "hermes", "yi-")):
        return get_chat_template("chatml")
    return get_chat_template("default")


@dataclass
class _Renderer:
    source: str
    special: dict[str, Any] = field(default_factory=dict)

    def __call__(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = False) -> str:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.TemplateError(message)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                   **self.special)


def _split(text: str, marker: str) -> tuple[str, str]:
    if text.count(marker) != 1:
        raise ValueError(f"expected the probe {marker!r} once in the rendered template, got {text!r}")
    prefix, suffix = text.split(marker)
    return prefix, suffix


def from_jinja(source: str, *, name: str = "hf", bos_token: str = "", eos_token: str = "") -> ChatTemplate | None:
    """Derive role prefix/suffix by rendering probe messages; None when the template is not separable."""
    render = _Renderer(source, {"bos_token": bos_token or "", "eos_token": eos_token or ""})
    sys_m, usr_m, ast_m = "\x02SYS\x03", "\x02USR\x03", "\x02AST\x03"
    try:
        r_s = render([{"role": "system", "content": sys_m}])
        r_su = render([{"role": "system", "content": sys_m}, {"role": "user", "content": usr_m}])
        r_sua = render([{"role": "system", "content": sys_m}, {"role": "user", "content": usr_m},
                        {"role": "assistant", "content": ast_m}])
        r_gen = render([{"role": "system", "content": sys_m}, {"role": "user", "content": usr_m}],
                       add_generation_prompt=True)
        r_u = render([{"role": "user", "content": usr_m}])
        if not (r_su.startswith(r_s) and r_sua.startswith(r_su) and r_gen.startswith(r_su)):
            return None
        system = _split(r_s, sys_m)
        user = _split(r_su[len(r_s):], usr_m)
        assistant = _split(r_sua[len(r_su):], ast_m)
    except Exception:  # any template that rejects the probes falls back to a named template
        return None
    gen_prompt = r_gen[len(r_su):]
    if gen_prompt and gen_prompt != assistant[0]:
        assistant = (gen_prompt, assistant[1])
    default_system = None
    before_user = r_u.split(usr_m)[0]
    if before_user != user[0] and before_user.endswith(user[0]):
        preamble = before_user[:len(before_user) - len(user[0])]
        if preamble.startswith(system[0]) and preamble.endswith(system[1]) and system[1]:
            default_system = preamble[len(system[0]):len(preamble) - len(system[1])]
    stop = assistant[1].strip()
    return ChatTemplate(name, {"system": system, "user": user, "assistant": assistant},
                        default_system_prompt=default_system, stop_str=(stop,) if stop else ())
