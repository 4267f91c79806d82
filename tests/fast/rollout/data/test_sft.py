"""Issue 35, SFT data with SmolLM2's real tokenizer and ChatML template: the conversation is
templated once and the loss mask is 1 on exactly the assistant content plus its ``<|im_end|>``
(never the ``<|im_start|>assistant\\n`` header, the newline after ``<|im_end|>`` or a user /
system turn), with several assistant turns; prompt + completion pairs; a template that is not
prefix-stable, a chat without an assistant turn and a chat without --apply-chat-template are
refused naming the record; the character tokenizer's pairs."""

from __future__ import annotations

import json
import re

import pytest

from rl_plugin.rollout.data.dataset import PromptRecord, read_prompts
from rl_plugin.rollout.data.sft import example_of, sft_tensors
from rl_plugin.rollout.data.tokenizer import CharTokenizer, load_tokenizer
from tests.fast.rollout.data.test_tokenizer import _write_chat_data
from tests.support import real_tokenizer

smollm2_tokenizer_dir = real_tokenizer.smollm2_tokenizer_dir  # the session fixture

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello there"},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
]


def _trained(adapter, ex):
    """The trained tokens as one decoded string per contiguous span."""
    spans, cur = [], []
    for i, m in zip(ex.ids, ex.mask):
        if m:
            cur.append(i)
        elif cur:
            spans.append(adapter.tok.decode(cur))
            cur = []
    if cur:
        spans.append(adapter.tok.decode(cur))
    return spans


def test_mask_is_the_assistant_content_and_its_end_of_turn_token(smollm2_tokenizer_dir):
    adapter = load_tokenizer(smollm2_tokenizer_dir, apply_chat_template=True)
    ex = example_of(adapter, PromptRecord(CHAT, None, 0, where="d.jsonl:1"))
    # templated once: the ids ARE the whole conversation's render
    whole = adapter.tok.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    assert ex.ids == list(whole)
    assert _trained(adapter, ex) == ["Hello there<|im_end|>", "4<|im_end|>"]
    im_end = adapter.tok.convert_tokens_to_ids("<|im_end|>")
    # the header before each trained span is untrained; the newline after <|im_end|> too
    first = ex.mask.index(1)
    assert adapter.tok.decode(ex.ids[first - 4 : first]) == "<|im_start|>assistant\n" and ex.mask[first - 1] == 0
    ends = [i for i, (t, m) in enumerate(zip(ex.ids, ex.mask)) if m and t == im_end]
    assert len(ends) == 2 and all(ex.mask[e + 1] == 0 for e in ends)
    assert adapter.tok.decode(ex.ids[ends[0] + 1]) == "\n"
    # the loss core's layout: the response starts at the first trained token
    t = sft_tensors([ex, ex])
    assert t["total_lengths"].tolist() == [len(ex.ids)] * 2
    assert t["response_lengths"].tolist() == [len(ex.ids) - first] * 2
    assert t["loss_mask"].tolist() == [float(m) for m in ex.mask[first:]] * 2


def test_prompt_completion_pairs_and_a_label_turn(smollm2_tokenizer_dir, tmp_path):
    adapter = load_tokenizer(smollm2_tokenizer_dir, apply_chat_template=True, system_prompt="Add.")
    rows = [{"prompt": "3 + 4?", "label": "7"}, {"prompt": [{"role": "user", "content": "1 + 1?"}], "label": "2"}]
    recs = read_prompts(_write_chat_data(tmp_path / "p.jsonl", rows), "prompt", "label")
    exs = [example_of(adapter, r) for r in recs]
    assert [_trained(adapter, e) for e in exs] == [["7<|im_end|>"], ["2<|im_end|>"]]
    assert "Add." in adapter.tok.decode(exs[0].ids)  # --system-prompt reaches the template


def test_refusals_name_the_record(smollm2_tokenizer_dir):
    adapter = load_tokenizer(smollm2_tokenizer_dir, apply_chat_template=True)
    with pytest.raises(ValueError, match="d.jsonl:7: the conversation has no assistant turn"):
        example_of(adapter, PromptRecord(CHAT[:2], None, 6, where="d.jsonl:7"))
    with pytest.raises(ValueError, match="d.jsonl:2: .*needs its completion under --label-key"):
        example_of(adapter, PromptRecord("Hi", None, 1, where="d.jsonl:2"))
    plain = load_tokenizer(smollm2_tokenizer_dir)
    with pytest.raises(ValueError, match="d.jsonl:3: .*Fix: pass --apply-chat-template"):
        example_of(plain, PromptRecord(CHAT, None, 2, where="d.jsonl:3"))


def test_a_template_that_rewrites_earlier_turns_is_refused(smollm2_tokenizer_dir):
    """A template that elides past assistant turns (as reasoning templates drop past thinking):
    the prefix render of turn 2 is not a token prefix of the whole conversation."""
    adapter = load_tokenizer(smollm2_tokenizer_dir, apply_chat_template=True)
    adapter.tok.chat_template = (
        "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}"
        "<|im_start|>assistant\n...<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ValueError, match="d.jsonl:5: the chat template is not prefix-stable at assistant turn 2"):
        example_of(adapter, PromptRecord(CHAT, None, 4, where="d.jsonl:5"))


def test_character_tokenizer_pairs():
    tok = CharTokenizer("0123456789+")
    ex = example_of(tok, PromptRecord("1+2", "3", 0, where="t:1"))
    assert ex.ids == [tok.bos_token_id] + tok.encode("1+2") + tok.encode("3") + [tok.eos_token_id]
    assert ex.mask == [0, 0, 0, 0, 1, 1]  # the completion and <eos> are trained
    with pytest.raises(ValueError, match="t:2: .*character tokenizer has no chat template"):
        example_of(tok, PromptRecord([{"role": "user", "content": "1"}], "1", 1, where="t:2"))


# -- issue 44 items 5, 21, 22, 24: the turn terminator, tool calls, the context, bytes ------------


@pytest.fixture
def eos_is_not_the_terminator(smollm2_tokenizer_dir, tmp_path):
    """SmolLM2's tokenizer with the EOS of a Qwen2.5 / Qwen3 base tokenizer: ``<|endoftext|>``,
    while the ChatML template still ends every turn with ``<|im_end|>``."""
    import shutil

    d = tmp_path / "base_eos"
    shutil.copytree(smollm2_tokenizer_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "<|endoftext|>"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_the_turn_terminator_comes_from_the_template_not_the_eos(eos_is_not_the_terminator):
    """Item 5. Before: the cut looked for the EOS (<|endoftext|>), found none, and trained the
    newline after every <|im_end|>: ['Hello there<|im_end|>\\n', '4<|im_end|>\\n']."""
    adapter = load_tokenizer(eos_is_not_the_terminator, apply_chat_template=True)
    im_end = adapter.tok.convert_tokens_to_ids("<|im_end|>")
    assert adapter.eos_token_id == adapter.tok.convert_tokens_to_ids("<|endoftext|>") != im_end
    ex = example_of(adapter, PromptRecord(CHAT, None, 0, where="d.jsonl:1"))
    assert _trained(adapter, ex) == ["Hello there<|im_end|>", "4<|im_end|>"]
    assert adapter.end_of_turn_ids() == [im_end]


def test_a_template_ending_turns_with_two_tokens(smollm2_tokenizer_dir):
    """A terminator of several tokens (``<|im_end|><|endoftext|>``) is cut after as a whole."""
    adapter = load_tokenizer(smollm2_tokenizer_dir, apply_chat_template=True)
    adapter.tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|><|endoftext|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    ex = example_of(adapter, PromptRecord(CHAT, None, 0, where="d.jsonl:1"))
    assert _trained(adapter, ex) == ["Hello there<|im_end|><|endoftext|>", "4<|im_end|><|endoftext|>"]
    assert adapter.tok.convert_ids_to_tokens(adapter.end_of_turn_ids()) == ["<|im_end|>", "<|endoftext|>"]


TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "Sunny, 21 C."},
]


def test_tool_calls_are_trained_in_the_agent_endpoints_hermes_form(smollm2_tokenizer_dir, tmp_path):
    """Item 22. Before: the reader dropped ``tool_calls`` (and refused content null), so with
    content "" the assistant turn trained ``<|im_end|>`` right after the question: an empty answer.
    SmolLM2's template ignores ``tool_calls``: the call is written as the agent endpoint parses it."""
    from rl_plugin.rollout.agent.chat import parse_tool_calls

    adapter = load_tokenizer(smollm2_tokenizer_dir, apply_chat_template=True)
    recs = read_prompts(_write_chat_data(tmp_path / "t.jsonl", [{"messages": TOOL_CHAT}]), "messages", None)
    spans = _trained(adapter, example_of(adapter, recs[0]))
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert spans == [call + "<|im_end|>", "Sunny, 21 C.<|im_end|>"]
    content, calls = parse_tool_calls(call)  # the endpoint reads back the call the model learns
    assert content is None and calls[0]["function"]["name"] == "weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    # content "" (the sweep's record) trains the same call, not an empty answer
    empty = [dict(m, content="") if m.get("tool_calls") else m for m in TOOL_CHAT]
    recs = read_prompts(_write_chat_data(tmp_path / "e.jsonl", [{"messages": empty}]), "messages", None)
    assert _trained(adapter, example_of(adapter, recs[0]))[0] == call + "<|im_end|>"


def test_a_template_that_reads_tool_calls_gets_them(smollm2_tokenizer_dir, tmp_path):
    """A template that renders ``tool_calls`` itself (as Qwen2.5's does) gets them structured,
    with the arguments as an object (never a JSON string to encode twice)."""
    adapter = load_tokenizer(smollm2_tokenizer_dir, apply_chat_template=True)
    adapter.tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}"
        "<tool_call>{{ c.function.name }}:{{ c.function.arguments | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    recs = read_prompts(_write_chat_data(tmp_path / "t.jsonl", [{"messages": TOOL_CHAT}]), "messages", None)
    spans = _trained(adapter, example_of(adapter, recs[0]))
    assert spans == ['<tool_call>weather:{"city": "Paris"}</tool_call><|im_end|>', "Sunny, 21 C.<|im_end|>"]


@pytest.mark.parametrize(
    "message, words",
    [
        ({"role": "assistant", "content": ""}, "message 1 is an assistant turn with no content and no tool_calls"),
        (
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]},
            "message 1 of 'messages': tool call 0 has no function name",
        ),
        (
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]},
            "the arguments of tool call 0 (f) are not valid JSON",
        ),
        (
            {"role": "user", "content": "", "tool_calls": [{"function": {"name": "f"}}]},
            "has 'tool_calls' but the role 'user'",
        ),
    ],
)
def test_bad_assistant_turns_are_refused_naming_the_line(smollm2_tokenizer_dir, tmp_path, message, words):
    adapter = load_tokenizer(smollm2_tokenizer_dir, apply_chat_template=True)
    chat = [CHAT[1], message, {"role": "user", "content": "?"}, {"role": "assistant", "content": "ok"}]
    path = _write_chat_data(tmp_path / "b.jsonl", [{"messages": CHAT}, {"messages": chat}])
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: ") + ".*" + re.escape(words)):
        [example_of(adapter, r) for r in read_prompts(path, "messages", None, label_optional=True)]


def test_a_line_that_is_not_utf8_is_named(tmp_path):
    """Item 24. Before: "'utf-8' codec can't decode byte 0xff in position 27: invalid start byte",
    no file, no line."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a", "label": "b"}\n{"prompt": "caf\xff", "label": "b"}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: not UTF-8 text (byte 0xff at column 16)")):
        read_prompts(path, "prompt", "label")


def test_a_conversation_longer_than_the_context_is_refused_naming_its_line(smollm2_tokenizer_dir, tmp_path):
    """Item 21. Before: the start-up check templated it and passed; Ray started and no step ended."""
    from rl_plugin.errors import RLArgumentError
    from rl_plugin.rollout.data.prompt_check import check_sft_file

    adapter = load_tokenizer(smollm2_tokenizer_dir, apply_chat_template=True)
    long_chat = [{"role": "user", "content": "Tell me."}, {"role": "assistant", "content": "word " * 300}]
    path = _write_chat_data(tmp_path / "l.jsonl", [{"messages": CHAT}, {"messages": long_chat}] * 2)
    kw = dict(input_key="messages", label_key=None, hf_checkpoint="M")
    assert check_sft_file("--prompt-data", path, adapter, context_len=400, **kw) > 300  # the longest fits 400
    with pytest.raises(RLArgumentError) as err:
        check_sft_file("--prompt-data", path, adapter, context_len=256, **kw)
    msg = str(err.value)
    assert msg.startswith(f"--loss-type sft_loss --prompt-data {path}:2: the conversation is "), msg
    assert "more than the 256 positions of the model (max_position_embeddings of --hf-checkpoint M)" in msg
    assert "(2 of 4 conversations, at lines 2, 4)" in msg and "never truncated" in msg and "Fix: shorten" in msg
