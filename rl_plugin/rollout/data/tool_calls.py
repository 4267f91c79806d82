"""Assistant ``tool_calls`` in chat data (OpenAI's form), as the chat template gets them.

A message ``{"role": "assistant", "content": str | null, "tool_calls": [call, ...]}``, each call
``{"type": "function", "function": {"name": str, "arguments": object | JSON string}}`` (or the flat
``{"name", "arguments"}``), is kept whole by the reader (``dataset.check_messages`` calls
``normalise``: arguments parsed into an object, a null content read as ""). Then, by template
(``with_tool_calls_rendered``, called by ``HFTokenizerAdapter.messages``):

- a template that reads ``tool_calls`` (Qwen2 / 2.5 / 3 ChatML) gets them as they are;
- a template that ignores them (SmolLM2's ChatML, Llama-2 style) gets them written into the
  content in the Hermes form the agent endpoint describes to the model and parses back
  (``rl_plugin.rollout.agent.chat``: ``tools_block``, ``parse_tool_calls``)::

      content + "\\n<tool_call>\\n" + json({"name": name, "arguments": arguments}) + "\\n</tool_call>"

  per call, in order (the leading newline dropped when the content is empty) — the form Qwen2.5's
  template writes. So an SFT turn that calls a tool trains the call the model must write, never an
  empty answer (issue 44 item 22), and an RL prompt holding one shows the model its earlier call.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List


def normalise(where: str, key: str, j: int, m: Dict[str, Any]) -> Dict[str, Any]:
    """Message ``j`` of ``key`` with its ``tool_calls`` checked and normalised (module docstring),
    or ``m`` unchanged when it has none; raises ``ValueError`` naming ``where`` and the call."""
    calls = m.get("tool_calls")
    if calls is None or calls == []:
        return {k: v for k, v in m.items() if k != "tool_calls"}
    at = f"{where}: message {j} of {key!r}"
    if m.get("role") != "assistant":
        raise ValueError(f"{at} has 'tool_calls' but the role {m.get('role')!r}; only an assistant turn calls tools")
    if not isinstance(calls, list):
        raise ValueError(f"{at}: 'tool_calls' must be a list of calls, got {type(calls).__name__}")
    out = []
    for c, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"{at}: tool call {c} has no function name (expected "
                f'{{"type": "function", "function": {{"name": ..., "arguments": {{...}}}}}}), got {call!r:.120}'
            )
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{at}: the arguments of tool call {c} ({name}) are not valid JSON ({exc.msg})"
                ) from None
        if not isinstance(arguments, dict):
            raise ValueError(
                f"{at}: the arguments of tool call {c} ({name}) must be a JSON object, got {arguments!r:.80}"
            )
        out.append({"type": "function", "function": {"name": name, "arguments": arguments}})
    content = "" if m.get("content") is None else m.get("content")
    return {**m, "content": content, "tool_calls": out}


def hermes_text(message: Dict[str, Any]) -> str:
    """The content of an assistant message with its calls written in the Hermes form."""
    calls = "".join(
        "\n<tool_call>\n"
        + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False)
        + "\n</tool_call>"
        for c in message["tool_calls"]
    )
    content = message["content"]
    return content + calls if content else calls[1:]


def with_tool_calls_rendered(messages: List[Dict[str, Any]], template_reads_them: bool) -> List[Dict[str, Any]]:
    """``messages`` as the template gets them: unchanged when it reads ``tool_calls``, else each
    call written into its message's content (``hermes_text``)."""
    if template_reads_them or not any(m.get("tool_calls") for m in messages):
        return messages
    return [{"role": m["role"], "content": hermes_text(m)} if m.get("tool_calls") else m for m in messages]
