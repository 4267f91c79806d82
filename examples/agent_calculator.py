"""An unmodified OpenAI-client agent with a calculator tool, trained through the agent endpoint.

``--custom-agent-function-path examples/agent_calculator.py:run_agent`` (miles' signature): for
every sample the rollout hands ``run_agent`` a session-scoped ``base_url``; the agent is plain
``openai`` code, nothing of rl_plugin in it:

1. it asks the question with ``tools=[calculator]`` (OpenAI function tools; SmolLM2's template
   ignores ``tools``, so the endpoint describes them in the system turn, Hermes style);
2. when the answer holds ``tool_calls`` it evaluates each expression safely (``safe_eval``:
   integers, + - * and parentheses) and sends the results back as ``role: tool`` messages,
   then asks again (at most ``MAX_TOOL_ROUNDS`` rounds);
3. the last answer is the model's reply.

The endpoint records every completion's ids and log-probs; the agent sends its history back as it
got it, so the episode is append-only and trains as one sample whose loss mask covers only the
model's completions (the tool results and the template's turn markers are masked).

``reward(prompt, response, label)`` (``--custom-rm-path examples/agent_calculator.py:reward``)
sees the final conversation after the prompt: 0.2 for a well-formed calculator call, and
0.8 * max(0, 1 - |v - label| / 20) for the last integer v of the conversation (the final answer),
graded by distance so a 135M model that is close has a gradient.

``python examples/agent_calculator.py prepare OUT`` writes ``train.jsonl`` / ``eval.jsonl``
(``{"prompt": "What is 23 + 19?", "label": "42"}``); ``examples/agent_calculator_cpu.sh`` trains
SmolLM2-135M-Instruct with it on a CPU.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import random
import re
from pathlib import Path

SYSTEM = "You are a careful assistant. Use the calculator tool for arithmetic, then reply with the number only."
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with integers, + - * and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 23 + 19"}},
            "required": ["expression"],
        },
    },
}
MAX_TOOL_ROUNDS = 2
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def safe_eval(expr: str):
    """The integer value of ``expr`` (integers, + - * and parentheses only), or None."""
    if not isinstance(expr, str) or not expr or len(expr) > 40:
        return None

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            out = _OPS[type(node.op)](value(node.left), value(node.right))
            if abs(out) > 10**12:
                raise ValueError("too large")
            return out
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(type(node).__name__)

    try:
        return value(ast.parse(expr, mode="eval").body)
    except (SyntaxError, ValueError):
        return None


def call_result(call) -> str:
    """The tool's answer to one OpenAI tool call."""
    try:
        args = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError:
        return "error: arguments are not JSON"
    v = safe_eval(args.get("expression")) if call.function.name == "calculator" and isinstance(args, dict) else None
    return "error: not an arithmetic expression" if v is None else str(v)


async def run_agent(base_url, prompt, request_kwargs=None):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    kwargs = dict(request_kwargs or {})
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    for _ in range(MAX_TOOL_ROUNDS + 1):
        answer = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR], **kwargs)
        choice = answer.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if not choice.message.tool_calls or choice.finish_reason == "length":
            break
        for call in choice.message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": call_result(call)})
    return None  # the run's reward (--custom-rm-path) scores the final conversation


def reward(prompt, response, label) -> float:
    """0.2 for a well-formed calculator call, + 0.8 graded by the final answer's distance (module docstring)."""
    called = any(
        safe_eval(json.loads(m).get("arguments", {}).get("expression")) is not None
        for m in re.findall(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", response, re.S)
        if _is_json_object(m)
    )
    numbers = re.findall(r"-?\d+", response)
    close = max(0.0, 1.0 - abs(int(numbers[-1]) - int(label)) / 20) if numbers else 0.0
    return 0.2 * called + 0.8 * close


def _is_json_object(text: str) -> bool:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("arguments"), dict)


def prepare(out: Path, seed: int = 0) -> None:
    out.mkdir(parents=True, exist_ok=True)
    pairs = [(a, b) for a in range(10, 60) for b in range(10, 60)]
    random.Random(seed).shuffle(pairs)
    rows = [{"prompt": f"What is {a} + {b}?", "label": str(a + b)} for a, b in pairs]
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[16:]))
    (out / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:16]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    prep = sub.add_parser("prepare", help="write train.jsonl / eval.jsonl under OUT")
    prep.add_argument("out", type=Path)
    a = p.parse_args(argv)
    prepare(a.out)
    print(a.out)


if __name__ == "__main__":
    main()
