"""The worked agent (``examples/agent_calculator.py``): its tool, its reward, and one rollout of
the unmodified ``openai``-client agent through the endpoint on the tiny chat model (hf engine)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("openai")

from rl_plugin.arguments.embedded import parse_train_flags  # noqa: E402
from rl_plugin.configs import RolloutConfig  # noqa: E402
from rl_plugin.models.smollm2 import tiny_chat_checkpoint  # noqa: E402
from rl_plugin.rollout.manager import RolloutManager  # noqa: E402
from tests.support.real_tokenizer import smollm2_tokenizer_path  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "agent_calculator.py"
spec = importlib.util.spec_from_file_location("agent_calculator", EXAMPLE)
calc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(calc)


def _call(name, arguments):
    return SimpleNamespace(function=SimpleNamespace(name=name, arguments=arguments))


def test_tool_and_reward():
    assert calc.call_result(_call("calculator", '{"expression": "23 + 19"}')) == "42"
    assert calc.call_result(_call("calculator", '{"expression": "__import__(1)"}')).startswith("error")
    assert calc.call_result(_call("other", '{"expression": "1+1"}')).startswith("error")
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "23+19"}}\n</tool_call>'
    assert calc.reward("p", f"{call}\ntool\n42\nassistant\n42", "42") == pytest.approx(1.0)
    assert calc.reward("p", "42", "42") == pytest.approx(0.8)
    assert calc.reward("p", f"{call} 32", "42") == pytest.approx(0.2 + 0.4)
    assert calc.reward("p", "The answer is 99", "42") == 0.0
    assert calc.reward("p", "no idea", "42") == 0.0


def test_the_agent_runs_through_the_endpoint(tmp_path):
    calc.prepare(tmp_path / "data")
    model = tiny_chat_checkpoint(tmp_path / "model", smollm2_tokenizer_path().parent)
    assert json.loads((tmp_path / "data" / "train.jsonl").read_text().splitlines()[0]).keys() == {"prompt", "label"}
    argv = ["--hf-checkpoint", str(model), "--prompt-data", str(tmp_path / "data" / "train.jsonl")]
    argv += ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "24"]
    argv += ["--num-rollout", "1", "--custom-agent-function-path", f"{EXAMPLE}:run_agent"]
    argv += ["--custom-rm-path", f"{EXAMPLE}:reward", "--output-dir", str(tmp_path / "out")]
    args = parse_train_flags(argv)
    m = RolloutManager(RolloutConfig.from_args(args), args.hf_checkpoint, args.prompt_data, None, args=args)
    data = m.generate(0)
    assert data.stats["agent/calls"] >= 4 and data.stats["agent/non_append_turns"] == 0
    assert data.stats["agent/model_tokens"] == data.stats["agent/completion_tokens"] <= 4 * 24
    # the tools reached the prompt (SmolLM2's template ignores `tools`: the system turn carries them)
    first = data.tokens[: int(data.total_lengths[0])].tolist()
    assert '"name": "calculator"' in m.generation.agent.template.decode(first)
