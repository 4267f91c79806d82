"""The agent endpoint's template (``rl_plugin.rollout.agent.template``) on SmolLM2's real tokenizer
and ChatML template: rendering with the generation prompt and the template kwargs, tools into the
system turn for a template that ignores them and as the ``tools`` argument for one that reads them,
refusals as 400s, the template's own ids, one-token stop strings, and the answer ids without their
stop id. (Which templates are append-only: ``test_records``.)"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from rl_plugin.rollout.agent.chat import RequestError, tools_block
from rl_plugin.rollout.agent.template import ChatTemplate
from tests.support import real_tokenizer

smollm2_tokenizer_dir = real_tokenizer.smollm2_tokenizer_dir  # the session fixture

USER = [{"role": "user", "content": "What is 3+4?"}]
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
# a ChatML template that reads ``tools`` (as Qwen2's does) and a kwarg (as Qwen3's enable_thinking)
READS_TOOLS = (
    "{% if tools %}{{ '<|im_start|>system\\nTOOLS:' + (tools | map(attribute='function.name') | join(',')) "
    "+ '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% if think is defined and not think %}"
    "{{ '<think></think>' }}{% endif %}{% endif %}"
)


@pytest.fixture
def tok(smollm2_tokenizer_dir):
    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


def test_render_adds_the_generation_prompt_and_ids_are_the_templates(tok):
    tpl = ChatTemplate(tok)
    assert tpl.has_template and not tpl.renders_tools
    text = tpl.render(USER)
    assert text.endswith("<|im_start|>user\nWhat is 3+4?<|im_end|>\n<|im_start|>assistant\n")
    ids = tpl.template_ids(USER)
    want = tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == list(want) and all(isinstance(i, int) for i in ids)
    assert tpl.decode(ids) == text
    assert tpl.eos_ids == {tok.eos_token_id}


def test_tools_go_into_the_system_turn_of_a_template_that_ignores_them(tok):
    tpl = ChatTemplate(tok)
    text = tpl.render(USER, TOOLS)
    assert text.startswith("<|im_start|>system\n" + tools_block(TOOLS) + "<|im_end|>\n")
    assert tpl.render(USER, []) == tpl.render(USER)


def test_a_template_that_reads_tools_gets_them_and_the_kwargs(tok):
    tok.chat_template = READS_TOOLS
    tpl = ChatTemplate(tok, {"think": False})
    assert tpl.renders_tools
    assert tpl.render(USER, TOOLS) == (
        "<|im_start|>system\nTOOLS:calc<|im_end|>\n<|im_start|>user\nWhat is 3+4?<|im_end|>\n"
        "<|im_start|>assistant\n<think></think>"
    )
    assert "<think>" not in ChatTemplate(tok).render(USER)


def test_refusals_are_400s_naming_messages(tok):
    tok.chat_template = "{{ raise_exception('only user turns') }}"
    with pytest.raises(RequestError) as info:
        ChatTemplate(tok).render(USER)
    assert (info.value.status, info.value.param) == (400, "messages")
    assert info.value.message.startswith("messages: the chat template refused them: ") and "only user turns" in (
        info.value.message
    )
    tok.chat_template = None
    with pytest.raises(
        RequestError, match=r"^messages: the checkpoint's tokenizer has no chat template; use /v1/completions"
    ):
        ChatTemplate(tok).render(USER)


def test_stop_strings_of_one_token_and_the_answer_ids(tok):
    tpl = ChatTemplate(tok)
    end = tpl.stop_id_of("<|im_end|>")
    assert end == tok.convert_tokens_to_ids("<|im_end|>")
    assert tpl.stop_id_of("The answer is") is None  # several tokens
    ids = tpl.encode("Seven") + [end]
    assert tpl.answer_ids(ids, "stop") == ids[:-1] and tpl.answer_ids(ids, "length") == ids
    assert tpl.answer_ids([], "stop") == []
    assert tpl.decode(ids, keep_special=False) == "Seven" and tpl.decode(ids).endswith("<|im_end|>")
    assert "".join(tpl.token_texts(ids[:-1])) == "Seven"
