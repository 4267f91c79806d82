"""Issue 22, the chat path with SmolLM2's real tokenizer and ChatML template: token ids (not the
keys of a BatchEncoding, transformers 5's return type of ``apply_chat_template(tokenize=True)``),
--system-prompt, --apply-chat-template-kwargs, chat-message prompts in JSONL and Parquet,
--metadata-key carried to the reward, and the start-up check that names a prompt whose ids are
not the tokens of its text."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from rl_plugin.arguments import RLArgumentError
from rl_plugin.arguments.embedded import parse_train_flags
from rl_plugin.rollout.data.dataset import read_prompts
from rl_plugin.rollout.data.prompt_check import check_prompt_file
from rl_plugin.rollout.data.tokenizer import CharTokenizer, HFTokenizerAdapter, as_ids, load_tokenizer
from rl_plugin.rollout.rewards.functions import RewardFunctionError, score_responses
from tests.support import real_tokenizer

smollm2_tokenizer_dir = real_tokenizer.smollm2_tokenizer_dir  # the session fixture

QUESTION = "What is 3 + 2? Answer with the number only."
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _render_ids(tok, text: str):
    """The ids of an already rendered chat: what the model must see (the template adds its own specials)."""
    return tok(text, add_special_tokens=False)["input_ids"]


def test_chat_template_gives_the_token_ids_of_the_rendered_chat(smollm2_tokenizer_dir):
    adapter = load_tokenizer(smollm2_tokenizer_dir, apply_chat_template=True)
    ids = adapter.prompt_ids(QUESTION)
    rendered = f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    assert ids == _render_ids(adapter.tok, rendered)
    assert all(type(i) is int for i in ids) and ids[0] == 1  # <|im_start|>
    assert len(ids) > len(QUESTION) // 5  # a real tokenization, not two dict keys


def test_batch_encoding_from_apply_chat_template_becomes_ids(smollm2_tokenizer_dir):
    """The bug of issue 22: ``list(BatchEncoding)`` is ['input_ids', 'attention_mask']."""
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    enc = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True)
    assert list(enc) == ["input_ids", "attention_mask"]  # what the old adapter returned as "token ids"
    assert as_ids(enc, "x") == list(enc["input_ids"])
    with pytest.raises(TypeError, match="'input_ids' \\(str\\) among the token ids"):
        as_ids(list(enc), "x")


def test_system_prompt_and_messages(smollm2_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    with_system = HFTokenizerAdapter(tok, True, system_prompt="Answer with digits.")
    as_messages = HFTokenizerAdapter(tok, True)
    msgs = [{"role": "system", "content": "Answer with digits."}, {"role": "user", "content": QUESTION}]
    ids = with_system.prompt_ids(QUESTION)
    assert ids == as_messages.prompt_ids(msgs)
    text = tok.decode(ids)
    assert "Answer with digits." in text and DEFAULT_SYSTEM not in text
    # the data's own system turn wins over --system-prompt
    own = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    assert with_system.prompt_ids(own) == as_messages.prompt_ids(own)


def test_chat_template_kwargs_reach_the_template(smollm2_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    tok.chat_template = (  # SmolLM2's template has no switch; a real jinja variable stands in for enable_thinking
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    )
    plain = HFTokenizerAdapter(tok, True).prompt_ids(QUESTION)
    off = HFTokenizerAdapter(tok, True, {"enable_thinking": False}).prompt_ids(QUESTION)
    assert off[: len(plain)] == plain and tok.decode(off[len(plain) :]) == "<think></think>"


def test_chat_flags_are_checked_at_parse_time(tmp_path, capsys):
    base = ["--prompt-data", "d.jsonl", "--rollout-batch-size", "2", "--rollout-max-response-len", "4"]
    base += ["--num-rollout", "1", "--rm-type", "math_exact"]
    args = parse_train_flags(
        base + ["--apply-chat-template", "--apply-chat-template-kwargs", '{"enable_thinking": false}']
    )
    assert args.apply_chat_template_kwargs == {"enable_thinking": False}
    for bad, says in (
        ("{enable_thinking: false}", "is not valid JSON"),
        ("[1]", "is a JSON list, not an object"),
        ('{"tokenize": false}', "tokenize is set by rl_plugin itself"),
    ):
        with pytest.raises(SystemExit):
            parse_train_flags(base + ["--apply-chat-template", "--apply-chat-template-kwargs", bad])
        assert says in capsys.readouterr().err
    for flag, value in (("--system-prompt", "Be brief."), ("--apply-chat-template-kwargs", "{}")):
        with pytest.raises(RLArgumentError, match=f"{flag} without --apply-chat-template"):
            parse_train_flags(base + [flag, value])


def _write_chat_data(path, rows):
    if str(path).endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


CHAT_ROWS = [
    {
        "messages": [
            {"role": "system", "content": "Answer with the number only."},
            {"role": "user", "content": f"{a} + 2?"},
        ],
        "label": str(a + 2),
        "meta": {"a": a},
    }
    for a in range(3)
]


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_chat_message_records_with_metadata(tmp_path, suffix):
    p = _write_chat_data(tmp_path / f"d.{suffix}", CHAT_ROWS)
    recs = read_prompts(p, "messages", "label", "meta")
    assert [r.prompt for r in recs] == [r["messages"] for r in CHAT_ROWS]
    assert [r.metadata for r in recs] == [{"a": 0}, {"a": 1}, {"a": 2}] and [r.label for r in recs] == ["2", "3", "4"]
    assert recs[1].where == (f"{p}:2" if suffix == "jsonl" else f"{p} row 2")


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
@pytest.mark.parametrize(
    "prompt, rule",
    [
        ([], "'messages' is an empty list of messages"),
        ([{"role": "user"}], "message 0 of 'messages' must be an object with string 'role' and 'content'"),
        ([{"role": "user", "content": "hi"}, {"content": "x"}], "message 1 of 'messages' must be"),
        ([{"role": "user", "content": "  "}], "every message of 'messages' is empty"),
    ],
)
def test_bad_chat_message_is_named_by_file_and_line(tmp_path, suffix, prompt, rule):
    rows = [{"messages": [{"role": "user", "content": "ok"}], "label": "1"}, {"messages": prompt, "label": "1"}]
    p = _write_chat_data(tmp_path / f"d.{suffix}", rows)
    where = f"{p}:2" if suffix == "jsonl" else f"{p} row 2"
    with pytest.raises(ValueError) as info:
        read_prompts(p, "messages", "label")
    assert str(info.value).startswith(f"{where}: {rule}"), str(info.value)


def test_metadata_reaches_a_reward_that_takes_it():
    seen = []

    def with_meta(prompt, response, label, metadata):
        seen.append(metadata)
        return float(response == label) + metadata.get("bonus", 0.0)

    out = score_responses(with_meta, ["p", "q"], ["5", "4"], ["5", "5"], [{"bonus": 0.5}, None])
    assert out == [1.5, 0.0] and seen == [{"bonus": 0.5}, {}]
    assert score_responses(lambda p, r, lab: float(r == lab), ["p"], ["5"], ["5"], [{"x": 1}]) == [1.0]  # 3-arg form
    with pytest.raises(RewardFunctionError, match=r"metadata=\.\.\."):
        score_responses(lambda p, r, lab, **kw: kw["metadata"]["missing"], ["p"], ["5"], ["5"], [{}])


def _check(path, tokenizer, ckpt, **kw):
    return check_prompt_file(
        "--prompt-data",
        path,
        tokenizer,
        input_key="messages",
        label_key="label",
        max_response_len=8,
        context_len=8192,
        hf_checkpoint=str(ckpt),
        vocab_size=49152,
        **kw,
    )


class _PreFixAdapter(HFTokenizerAdapter):
    """The adapter as it was before issue 22: ``list()`` of what apply_chat_template returned."""

    def prompt_ids(self, prompt):
        return list(self.tok.apply_chat_template(self.messages(prompt), add_generation_prompt=True, tokenize=True))


def test_preflight_names_a_prompt_whose_ids_are_not_its_tokens(tmp_path, smollm2_tokenizer_dir):
    p = _write_chat_data(tmp_path / "d.jsonl", CHAT_ROWS)
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    assert _check(p, HFTokenizerAdapter(tok, True), smollm2_tokenizer_dir, metadata_key="meta") > 20
    with pytest.raises(
        RLArgumentError, match=rf"--prompt-data {p}:1: .*returned 'input_ids' \(str\) among the token ids"
    ):
        _check(p, _PreFixAdapter(tok, True), smollm2_tokenizer_dir)
    long_text = [{"messages": [{"role": "user", "content": "word " * 100}], "label": "1"}]
    p2 = _write_chat_data(tmp_path / "long.parquet", CHAT_ROWS[:1] + long_text)

    class TwoIds(HFTokenizerAdapter):  # a tokenizer that yields a handful of (integer) ids for any text
        def prompt_ids(self, prompt):
            return [1, 2] if len(self.messages(prompt)[-1]["content"]) > 100 else super().prompt_ids(prompt)

    with pytest.raises(RLArgumentError, match=rf"{p2} row 2: .*gives 2 token ids .* for a prompt of 500 characters"):
        _check(p2, TwoIds(tok, True), smollm2_tokenizer_dir)
    with pytest.raises(
        RLArgumentError, match=rf"{p}:1: the prompt is a list of chat messages.*Fix: pass --apply-chat-template"
    ):
        _check(p, HFTokenizerAdapter(tok, False), smollm2_tokenizer_dir)
    with pytest.raises(RLArgumentError, match=r"token id 49151, outside the model's vocabulary of 100"):
        check_prompt_file(
            "--prompt-data",
            p,
            type("Top", (), {"prompt_ids": lambda self, pr: [49151] * 40})(),
            input_key="messages",
            label_key="label",
            max_response_len=8,
            context_len=None,
            hf_checkpoint="m",
            vocab_size=100,
        )


def test_char_tokenizer_round_trip(tmp_path):
    tok = CharTokenizer("0123456789")
    ids = tok.prompt_ids("314=")
    assert ids == [1, 7, 5, 8, 3]
    assert tok.decode([7, 5, 2, 9]) == "31"  # stops at <eos>
    tok.save(tmp_path)
    assert load_tokenizer(tmp_path).prompt_ids("314=") == ids
    with pytest.raises(ValueError, match=r"character 'x' at position 1 of '3x'"):
        tok.encode("3x")
