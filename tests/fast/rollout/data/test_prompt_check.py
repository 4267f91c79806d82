"""Chat data refused before Ray starts, naming file:line (issue 38): a chat that ends in an
assistant turn (its answer would be in the prompt), an unknown role, OpenAI's content parts, and
``--apply-chat-template-kwargs`` that break the template (named, not the prompt), on SmolLM2's real
tokenizer and ChatML template."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from rl_plugin.errors import RLArgumentError
from rl_plugin.rollout.data.dataset import read_prompts
from rl_plugin.rollout.data.tokenizer import HFTokenizerAdapter
from tests.fast.rollout.data.test_tokenizer import _check, _write_chat_data
from tests.support import real_tokenizer

smollm2_tokenizer_dir = real_tokenizer.smollm2_tokenizer_dir  # the session fixture

USER = {"role": "user", "content": "what is 1+2?"}
SFT_ROW = {"messages": [USER, {"role": "assistant", "content": "3"}], "label": "3"}
OK_ROW = {"messages": [USER], "label": "3"}


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_a_chat_ending_in_an_assistant_turn_is_refused_naming_its_line(tmp_path, smollm2_tokenizer_dir, suffix):
    """Before: preflight passed and the model saw ``...<user>what is 1+2?<assistant>3<assistant>``."""
    p = _write_chat_data(tmp_path / f"d.{suffix}", [OK_ROW, SFT_ROW, OK_ROW, SFT_ROW])
    adapter = HFTokenizerAdapter(AutoTokenizer.from_pretrained(smollm2_tokenizer_dir), True)
    where = f"{p}:2" if suffix == "jsonl" else f"{p} row 2"
    with pytest.raises(RLArgumentError) as info:
        _check(p, adapter, smollm2_tokenizer_dir)
    msg = str(info.value)
    assert msg.startswith(f"--prompt-data {where}: the chat ends in an assistant turn"), msg
    assert "(2 of 4 prompts, at " in msg and " 2, 4)" in msg and "Fix: drop the final assistant message" in msg
    assert _check(p, adapter, smollm2_tokenizer_dir, answers_are_targets=True) > 0  # the SFT loss's case


def test_the_trainer_refuses_it_before_ray(tmp_path, capsys, smollm2_tokenizer_dir):
    from rl_plugin.models.smollm2 import tiny_chat_checkpoint
    from rl_plugin.train import main

    model = tiny_chat_checkpoint(tmp_path / "model", smollm2_tokenizer_dir.parent)
    p = _write_chat_data(tmp_path / "d.jsonl", [OK_ROW, SFT_ROW])
    argv = ["--train-backend", "fsdp", "--hf-checkpoint", str(model), "--prompt-data", str(p)]
    argv += ["--input-key", "messages", "--apply-chat-template", "--rm-type", "math_exact", "--num-rollout", "1"]
    argv += ["--rollout-batch-size", "2", "--rollout-max-response-len", "4", "--output-dir", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--prompt-data {p}:2: the chat ends in an assistant turn" in err, err


@pytest.mark.parametrize(
    "message, rule",
    [
        ({"role": "narrator", "content": "x"}, "message 1 of 'messages' has the role 'narrator', which chat templates"),
        (
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            "message 1 of 'messages' gives its content as a list of parts (OpenAI's multi-part form), which rl_plugin "
            "does not support",
        ),
    ],
)
def test_unknown_roles_and_content_parts_are_refused_saying_why(tmp_path, message, rule):
    p = _write_chat_data(tmp_path / "d.jsonl", [{"messages": [USER, message], "label": "1"}])
    with pytest.raises(ValueError) as info:
        read_prompts(p, "messages", "label")
    assert str(info.value).startswith(f"{p}:1: {rule}"), str(info.value)


def test_chat_template_kwargs_that_break_the_template_are_named_not_the_prompt(tmp_path, smollm2_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    tok.chat_template = (  # a template that reads `tools` as a list, as tool-calling templates do
        "{% if tools %}{% for t in tools %}{{ t }}{% endfor %}{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n"
    )
    p = _write_chat_data(tmp_path / "d.jsonl", [OK_ROW])
    with pytest.raises(RLArgumentError) as info:
        _check(p, HFTokenizerAdapter(tok, True, {"tools": 5}), smollm2_tokenizer_dir)
    msg = str(info.value)
    assert msg.startswith('--apply-chat-template-kwargs {"tools": 5}: the chat template'), msg
    assert f"on --prompt-data {p}:1, which it renders without them" in msg
