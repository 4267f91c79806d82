"""Issue 37 #11: one ``--custom-rm-path`` reward sees one prompt form whatever generates the
samples. slime's ``Sample.prompt`` (``slime/utils/data.py``: ``Dataset``) is the dataset's prompt
after the chat template with ``--apply-chat-template`` (``tokenize=False, add_generation_prompt=True``)
and the prompt itself without; the default generate function gave the reward the record's raw
prompt (the chat messages) while a generate hook's samples carried the templated text. Here the
same rm scores a rollout of each path, on a tiny model with SmolLM2's real tokenizer and ChatML
template, and records what it got."""

from __future__ import annotations

import json

import pytest

from rl_plugin.arguments.embedded import parse_train_flags
from rl_plugin.configs import RolloutConfig
from rl_plugin.models.smollm2 import tiny_chat_checkpoint
from rl_plugin.rollout.manager import RolloutManager
from tests.support.real_tokenizer import smollm2_tokenizer_path

HOOK = """
from rl_plugin.rollout import Sample, generate_tokens

async def one_turn(args, sample, sampling_params):
    out = await generate_tokens(args, sample.tokens, sampling_params)
    sample.tokens = sample.tokens + list(out["output_ids"])
    sample.response_length = len(out["output_ids"])
    sample.loss_mask = [1] * sample.response_length
    sample.rollout_log_probs = list(out["output_log_probs"])
    sample.status = Sample.Status.COMPLETED if out["finish_reason"] == "stop" else Sample.Status.TRUNCATED
    return sample
"""
RM = """
SEEN = []

async def rm(args, sample):
    SEEN.append(sample.prompt)
    return 0.0
"""
MESSAGES = [
    [{"role": "system", "content": "Answer with the number only."}, {"role": "user", "content": f"{a} + 2?"}]
    for a in range(2)
]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    tok = smollm2_tokenizer_path()
    return tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_chat"), tok.parent)


def _seen(tmp_path, model, rows, template: bool, hook: bool):
    tmp_path.mkdir()
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"q": q, "label": "2"}) + "\n" for q in rows))
    (tmp_path / "hook.py").write_text(HOOK)
    (tmp_path / "rm.py").write_text(RM)
    argv = ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--input-key", "q"]
    argv += ["--custom-rm-path", f"{tmp_path / 'rm.py'}:rm", "--rollout-max-response-len", "2"]
    argv += ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1"]
    argv += ["--global-batch-size", "4", "--output-dir", str(tmp_path / "o")]
    argv += ["--apply-chat-template", "--system-prompt", "Be brief."] if template else []
    argv += ["--custom-generate-function-path", f"{tmp_path / 'hook.py'}:one_turn"] if hook else []
    args = parse_train_flags(argv)
    m = RolloutManager(RolloutConfig.from_args(args), args.hf_checkpoint, args.prompt_data, None, args=args)
    m.generate(0)
    seen = list(m.generation.scorer.fn.fn.__globals__["SEEN"])
    return seen, m.generation.tokenizer


@pytest.mark.parametrize(
    "rows, template",
    [(MESSAGES, True), (["What is 1 + 2?", "What is 0 + 2?"], True), (["What is 1 + 2?", "What is 0 + 2?"], False)],
    ids=["chat-messages", "string-templated", "string-plain"],
)
def test_the_reward_sees_one_prompt_form_with_and_without_a_generate_hook(tmp_path, chat_model, rows, template):
    plain, tok = _seen(tmp_path / "plain", chat_model, rows, template, hook=False)
    hooked, _ = _seen(tmp_path / "hook", chat_model, rows, template, hook=True)
    assert sorted(map(repr, plain)) == sorted(map(repr, hooked)), (plain, hooked)  # before: messages vs text
    want = [tok.prompt_text(r) for r in rows for _ in range(2)]
    assert sorted(map(repr, plain)) == sorted(map(repr, want))
    if template:  # slime's form: the rendered chat with the generation prompt, a string
        assert all(isinstance(p, str) and p.endswith("<|im_start|>assistant\n") for p in plain), plain
        assert all("<|im_start|>user\n" in p and " + 2?" in p for p in plain), plain
    else:
        assert sorted(plain) == sorted(r for r in rows for _ in range(2))
