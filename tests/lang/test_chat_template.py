"""Role markers from Jinja templates and the named fallbacks; s.messages()."""
from __future__ import annotations

import pytest

import radixlang.lang as sgl
from radixlang.lang.chat_template import from_jinja, get_chat_template, match_chat_template
from fake_backend import FakeBackend

SMOLLM = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
          "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
NO_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
             "{{ m['content'] }}{% endfor %}")


def test_from_jinja_chatml_with_default_system_prompt():
    t = from_jinja(SMOLLM)
    assert t.role_prefix_and_suffix["user"] == ("<|im_start|>user\n", "<|im_end|>\n")
    assert t.role_prefix_and_suffix["assistant"] == ("<|im_start|>assistant\n", "<|im_end|>\n")
    assert t.default_system_prompt == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert t.stop_str == ("<|im_end|>",)


def test_from_jinja_llama3_bos_goes_with_first_system_turn():
    t = from_jinja(LLAMA3, bos_token="<|begin_of_text|>")
    assert t.role_prefix_and_suffix["system"][0] == "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    assert t.role_prefix_and_suffix["user"] == ("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>")
    assert t.default_system_prompt is None
    assert t.stop_str == ("<|eot_id|>",)


def test_from_jinja_unusable_template_is_none():
    assert from_jinja(NO_SYSTEM) is None
    assert from_jinja("{{ oops") is None


def test_named_templates_and_matching():
    assert get_chat_template("chatml").stop_str == ("<|im_end|>",)
    assert get_chat_template("llama-3") is not None and get_chat_template("llama-2") is not None
    assert match_chat_template("/models/Meta-Llama-3-8B-Instruct").name == "llama-3-instruct"
    assert match_chat_template("/m/Qwen2-0.5B").name == "chatml"
    assert match_chat_template(None).name == "default"
    with pytest.raises(ValueError, match="chat template must be one of"):
        get_chat_template("nope")


def test_llama2_user_after_system_shares_the_inst_block():
    t = get_chat_template("llama-2")
    hist = [{"role": "system", "content": "S"}]
    assert t.get_prefix_and_suffix("user", hist)[0] == ""
    assert t.get_prefix_and_suffix("user", [])[0] == "[INST] "


def test_roles_render_text_and_messages_with_default_system():
    be = FakeBackend(lambda t, p: "Hi there", template=from_jinja(SMOLLM))

    @sgl.function
    def chat(s, q):
        s += sgl.user(q)
        s += sgl.assistant(sgl.gen("answer", max_tokens=8))
        with s.user():
            s += "thanks"
        s += sgl.assistant_begin() + "ok" + sgl.assistant_end()

    state = chat.run(q="hello", backend=be)
    assert state.messages() == [
        {"role": "system", "content": "You are a helpful AI assistant named SmolLM, trained by Hugging Face"},
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hi there"},
        {"role": "user", "content": "thanks"}, {"role": "assistant", "content": "ok"}]
    text = state.text()
    assert text.startswith("<|im_start|>system\nYou are a helpful")
    assert "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nHi there<|im_end|>\n" in text
    prompt, params, messages = be.of_kind("generate")[0]
    assert prompt.endswith("<|im_start|>assistant\n")
    assert params.sampling_params["stop"] == ["<|im_end|>"]  # the template's stop string is added
    assert messages == state.messages()[:2]  # the gen opens the assistant turn


def test_explicit_system_suppresses_default_and_nesting_is_an_error():
    be = FakeBackend(template=from_jinja(SMOLLM))

    @sgl.function
    def prog(s):
        s += sgl.system("Be brief.") + sgl.user("q")

    assert prog.run(backend=be).messages()[0] == {"role": "system", "content": "Be brief."}

    @sgl.function
    def bad(s):
        s += sgl.user_begin() + sgl.assistant_begin()

    state = bad.run(backend=be)
    assert isinstance(state.error(), ValueError) and "do not nest" in str(state.error())


def test_default_template_markers():
    be = FakeBackend(lambda t, p: "A")

    @sgl.function
    def prog(s):
        s += sgl.system("S") + sgl.user("U") + sgl.assistant(sgl.gen("a"))

    assert prog.run(backend=be).text() == "SYSTEM:S\nUSER:U\nASSISTANT:A\n"
