"""The multi-turn tool-use example (``examples/calculator_tool.py``): the safe evaluator, the
reward's parts, and one rollout of its hook on its tiny model (real ``hf`` engine): the tool turn
is exactly the ids of the evaluated result, masked, between two model turns."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from rl_plugin.arguments.embedded import parse_train_flags
from rl_plugin.configs import RolloutConfig
from rl_plugin.rollout.manager import RolloutManager
from tests.support import real_tokenizer

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "calculator_tool.py"
smollm2_tokenizer_dir = real_tokenizer.smollm2_tokenizer_dir  # the session fixture
spec = importlib.util.spec_from_file_location("calculator_tool", EXAMPLE)
calc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(calc)


def test_safe_eval_evaluates_arithmetic_only():
    assert calc.safe_eval("3+4") == 7 and calc.safe_eval("(2+3)*4-1") == 19 and calc.safe_eval("-2*3") == -6
    for bad in ("", "3+", "__import__('os')", "2**8", "1/2", "a+1", "9" * 50, "3.5+1", "99999999*99999999"):
        assert calc.safe_eval(bad) is None, bad


@pytest.mark.parametrize(
    "response, want",
    [
        ("[3+4]=7=7", 1.0),  # call, right value, the answer copies it and is right
        ("[3+4]=7=8", 0.4),
        ("[3+5]=8=8", 0.1 + 0.27 + 0.2),  # a call one off, its value copied
        ("[3+5]=8=7", 0.1 + 0.27 + 0.4),  # ... the answer right anyway
        ("[3+]=-=", 0.0),  # a call that does not evaluate
        ("[99]=99=", 0.1),  # far off, no answer
        ("7", 0.4),  # no call, right answer
        ("8", 0.0),
        ("<calc>3 + 4</calc><result>7</result>7", 1.0),
    ],
)
def test_reward_parts(response, want):
    assert calc.reward("3+4", response, "7") == pytest.approx(want)


def test_hook_rollout_on_the_tiny_model(tmp_path):
    calc.prepare(tmp_path / "data", "tiny", 9)
    train = tmp_path / "data" / "train.jsonl"
    assert json.loads(train.read_text().splitlines()[0]).keys() == {"prompt", "label"}
    args = parse_train_flags(
        [
            "--hf-checkpoint",
            str(tmp_path / "data" / "model"),
            "--prompt-data",
            str(train),
            "--rollout-batch-size",
            "32",
            "--n-samples-per-prompt",
            "8",
            "--rollout-max-response-len",
            "8",
            "--num-rollout",
            "1",
            "--custom-generate-function-path",
            f"{EXAMPLE}:generate",
            "--custom-rm-path",
            f"{EXAMPLE}:reward",
            "--output-dir",
            str(tmp_path / "out"),
        ]
    )
    m = RolloutManager(RolloutConfig.from_args(args), args.hf_checkpoint, args.prompt_data, None, args=args)
    data = m.generate(0)
    tok = calc._tokenizer(args.hf_checkpoint)
    responses = [
        t[-int(r) :] for t, r in zip(data.tokens.split(data.total_lengths.tolist()), data.response_lengths.tolist())
    ]
    masks = data.loss_mask.split(data.response_lengths.tolist())
    called = 0
    for ids, mask in zip(responses, masks):
        text = tok.decode(ids.tolist())
        call = calc.parse_call(text, calc.CHAR_TAGS)
        if call is None or (mask == 1).all():
            continue
        called += 1
        tool = tok.encode(calc.tool_text(calc.safe_eval(call[1]), calc.CHAR_TAGS))
        start = len(tok.encode(call[0]))
        assert ids[start : start + len(tool)].tolist() == tool  # the hook's ids, where it put them
        assert mask.tolist() == [1] * start + [0] * len(tool) + [1] * (len(mask) - start - len(tool))
    assert called >= 1 and data.stats["multi_turn/tool_calls_mean"] == called / 256
    assert torch.isfinite(data.rewards).all()


def test_real_tokenizer_call_is_cut_after_the_closing_tag(smollm2_tokenizer_dir):
    """The BPE path: the call turn's ids are cut after the token that completes ``</calc>`` (no
    re-tokenisation), the tool turn is the tokenizer's ids of ``<result>v</result>``."""
    from rl_plugin.rollout.data.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_tokenizer_dir)
    ids = tok.tok.encode("<calc>3 + 4</calc> so the answer", add_special_tokens=False)
    k = calc._cut_after(tok, ids, "</calc>")
    assert tok.decode(ids[:k]).endswith("</calc>") and not tok.decode(ids[: k - 1]).endswith("</calc>")
    call = calc.parse_call(tok.decode(ids[:k]), calc.TEXT_TAGS)
    assert call[1] == "3 + 4" and calc.safe_eval(call[1]) == 7
    tool = calc._encode(tok, calc.tool_text(7, calc.TEXT_TAGS))
    assert tok.decode(tool) == "<result>7</result>"
    prompt = calc.SYSTEM
    assert calc.reward(prompt, "<calc>3 + 4</calc><result>7</result>It is 7.", "7") == pytest.approx(1.0)
    assert calc.reward(prompt, "3 + 4 is 7", "7") == pytest.approx(0.4)
