"""Issue 35, SFT data with SmolLM2's real tokenizer and ChatML template: the conversation is
templated once and the loss mask is 1 on exactly the assistant content plus its ``<|im_end|>``
(never the ``<|im_start|>assistant\\n`` header, the newline after ``<|im_end|>`` or a user /
system turn), with several assistant turns; prompt + completion pairs; a template that is not
prefix-stable, a chat without an assistant turn and a chat without --apply-chat-template are
refused naming the record; the character tokenizer's pairs."""

from __future__ import annotations

import pytest

from rl_plugin.rollout.data.dataset import PromptRecord, read_prompts
from rl_plugin.rollout.data.sft import example_of, sft_tensors
from rl_plugin.rollout.data.tokenizer import CharTokenizer, load_tokenizer
from tests.fast.rollout.test_chat_prompts import _write_chat_data
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
