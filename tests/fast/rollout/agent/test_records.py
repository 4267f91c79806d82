"""Issue 36: which chat templates are append-only (``rl_plugin.rollout.agent.template``), the
records -> samples rule, and tool calls (Hermes / Qwen2 ``<tool_call>`` JSON) -> OpenAI
``tool_calls``, with SmolLM2's real tokenizer and template."""

from __future__ import annotations

import json

from transformers import AutoTokenizer

from rl_plugin.rollout.agent.chat import parse_tool_calls, tools_block
from rl_plugin.rollout.agent.records import TurnRecord, episode_samples, non_append_turns
from rl_plugin.rollout.agent.sessions import Session
from rl_plugin.rollout.agent.template import ChatTemplate
from rl_plugin.rollout.sample import Sample
from tests.support import real_tokenizer

smollm2_tokenizer_dir = real_tokenizer.smollm2_tokenizer_dir  # the session fixture

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
# a template that re-renders earlier turns as Qwen3's does: the <think> block of an assistant
# turn is dropped once another turn follows it
STRIP_THINKING = (
    "{% for m in messages %}{% set c = m['content'] %}"
    "{% if m['role'] == 'assistant' and not loop.last and '</think>' in c %}{% set c = c.split('</think>')[-1] %}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _turns(tpl: ChatTemplate, answers, tools=None):
    """Serve ``answers`` (texts the "model" wrote, ids from the tokenizer) turn by turn through a
    session, the agent sending each answer back plus a tool or user turn; the session's records."""
    s = Session("s", Sample(prompt="p"), budget=10_000)
    msgs = [{"role": "user", "content": "What is 3+4?"}]
    for k, text in enumerate(answers):
        rendered = tpl.render(s.raw_messages(msgs), tools)
        ids, appended = s.prompt_ids(
            rendered, lambda m=list(msgs): tpl.template_ids(s.raw_messages(m), tools), tpl.encode
        )
        out = tpl.encode(text) + [tpl.tok.eos_token_id]
        rec = TurnRecord(ids, out, [-1.0] * len(out), "stop", appended, raw_text=text)
        content, calls = parse_tool_calls(text) if tools else (text, [])
        s.add(rec, tpl.decode(rec.full_ids), content, [c["id"] for c in calls])
        answer = {"role": "assistant", "content": content}
        if calls:
            answer["tool_calls"] = calls
        follow = {"role": "tool", "content": "7"} if calls else {"role": "user", "content": f"turn {k}"}
        msgs = msgs + [answer, follow]
    return s.records


def test_smollm2_chatml_is_append_only_with_tools(smollm2_tokenizer_dir):
    tpl = ChatTemplate(AutoTokenizer.from_pretrained(smollm2_tokenizer_dir))
    assert not tpl.renders_tools  # SmolLM2's template ignores `tools`: they go into the system turn
    call = '<tool_call>\n{"name": "calc", "arguments": {"expression": "3+4"}}\n</tool_call>'
    records = _turns(tpl, [call, "The answer is 7."], TOOLS)
    assert non_append_turns(records) == 0
    first_text = tpl.decode(records[0].prompt_ids)
    assert "<tools>" in first_text and '"name": "calc"' in first_text
    (sample,) = episode_samples(records, Sample(prompt="p"))
    resp = sample.tokens[sample.prompt_length :]
    trained = [t for t, k in zip(resp, sample.loss_mask) if k]
    assert trained == records[0].output_ids + records[1].output_ids
    between = [t for t, k in zip(resp, sample.loss_mask) if not k]
    assert tpl.decode(between) == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"


def test_plain_chatml_turns_are_append_only(smollm2_tokenizer_dir):
    tpl = ChatTemplate(AutoTokenizer.from_pretrained(smollm2_tokenizer_dir))
    records = _turns(tpl, ["Seven.", " 7", "It is 7"])
    assert non_append_turns(records) == 0 and len(episode_samples(records, Sample())) == 1
    # the first prompt is exactly the template's tokenisation
    want = tpl.tok.apply_chat_template(
        [{"role": "user", "content": "What is 3+4?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert records[0].prompt_ids == list(want)


def test_a_template_that_re_renders_earlier_turns_is_not(smollm2_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    tok.chat_template = STRIP_THINKING
    tpl = ChatTemplate(tok)
    records = _turns(tpl, ["<think>3+4</think>7", "<think>again</think>7", "7"])
    # every later turn renders the earlier answers without their thinking: none extends the previous
    assert [r.appended for r in records] == [False, False, False] and non_append_turns(records) == 2
    samples = episode_samples(records, Sample(group_index=3))
    assert len(samples) == 3 and all(s.group_index == 3 for s in samples)
    for s, r in zip(samples, records):
        assert s.tokens == r.full_ids and s.loss_mask == [1] * len(r.output_ids)


def test_tool_call_text_becomes_openai_tool_calls():
    text = 'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "2*(3+4)"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me compute." and len(calls) == 1
    assert calls[0]["function"]["name"] == "calc" and json.loads(calls[0]["function"]["arguments"]) == {
        "expression": "2*(3+4)"
    }
    assert parse_tool_calls("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert "calc" in tools_block(TOOLS)
