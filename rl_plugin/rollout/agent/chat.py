"""The OpenAI request and answer formats of the agent endpoint: what is accepted, how messages
become the chat template's text, how an answer's text becomes OpenAI ``tool_calls``.

Accepted (anything else is a 400 naming the field; the engines' sampling is all there is):

- chat: ``messages``, ``model`` (ignored), ``max_tokens`` / ``max_completion_tokens``,
  ``temperature`` (> 0: a rollout samples), ``top_p``, ``top_k``, ``stop`` (strings that are ONE
  token of the tokenizer, e.g. ``"<|im_end|>"``: the engines stop on ids), ``stop_token_ids``,
  ``n`` (1), ``logprobs`` / ``top_logprobs`` (0), ``tools`` (passed to the chat template),
  ``tool_choice`` ("auto" / "none"), ``parallel_tool_calls``, ``user``, ``stream`` (false only),
  ``return_prompt_token_ids`` (the prompt ids back as ``prompt_token_ids``, as SGLang does);
  with ``--multimodal-keys``, ``image_url`` content parts in any message (``images``);
- completions: ``prompt`` (a string or token ids), and the same sampling fields; ``logprobs``
  0 / 1 / None (each token's own log-prob), ``echo`` false.

Every answer carries ``usage`` (``prompt_tokens``, ``completion_tokens``: the output ids, the
stop id included) and ``choices[0].token_ids`` (the output ids, vLLM's name).

Tools: a template that reads ``tools`` (Qwen2/2.5's ChatML) renders them itself; for a template
that ignores them (SmolLM2's, Llama-2 style) the tools are described in the system message in the
same Hermes form, so the model can call them either way. An answer whose text holds
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2's and Hermes' form)
gets them as OpenAI ``tool_calls`` (finish_reason "tool_calls"), the rest as ``content``; a block
that is not valid JSON stays text. The raw ids are recorded either way.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

SAMPLING_KEYS = {"max_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "n"}
COMMON_KEYS = SAMPLING_KEYS | {"model", "user", "stream", "return_prompt_token_ids", "logprobs"}
CHAT_KEYS = COMMON_KEYS | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
}
COMPLETION_KEYS = COMMON_KEYS | {"prompt", "echo"}

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


class RequestError(Exception):
    """An answer other than 200: ``status``, the message, the request field at fault (``param``)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def bad(param: str, message: str) -> RequestError:
    return RequestError(400, f"{param}: {message}", param)


def _int(body, key, lo: int = 1) -> Optional[int]:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise bad(key, f"must be an integer >= {lo}, got {v!r}")
    return v


def sampling_params(body: Dict[str, Any], keys: frozenset, stop_id_of) -> Dict[str, Any]:
    """The SGLang-spelled sampling params of a request (``generate.sampling_params_of`` reads
    them), after refusing what the endpoint does not serve. ``stop_id_of(text)`` is the one id of
    a stop string, or None when it is not one token."""
    unknown = sorted(set(body) - keys)
    if unknown:
        raise bad(unknown[0], f"not supported by this endpoint (unknown field(s) {unknown}); accepted: {sorted(keys)}")
    if body.get("stream"):
        raise bad("stream", "streaming is not supported: send stream=false (the default) and read the whole answer")
    if body.get("n", 1) != 1:
        raise bad("n", f"only n=1 is served (got {body.get('n')!r}); send one request per completion")
    if "echo" in body and body["echo"]:
        raise bad("echo", "echo is not supported; ask for return_prompt_token_ids instead")
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise bad("top_logprobs", f"only 0 is served (got {top!r}): the engines return the sampled token's log-prob")
    lp = body.get("logprobs")
    if "prompt" in body and lp not in (None, 0, 1, False, True):
        raise bad("logprobs", f"only 0 or 1 is served (got {lp!r}): the engines return the sampled token's log-prob")
    out: Dict[str, Any] = {}
    max_tokens = _int(body, "max_completion_tokens")
    max_tokens = _int(body, "max_tokens") if max_tokens is None else max_tokens
    if max_tokens is not None:
        out["max_new_tokens"] = max_tokens
    for key in ("temperature", "top_p"):
        v = body.get(key)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise bad(key, f"must be a number, got {v!r}")
            out[key] = float(v)
    if out.get("temperature") is not None and not out["temperature"] > 0:
        raise bad("temperature", f"must be > 0 (got {out['temperature']}): a rollout samples, greedy is not served")
    if out.get("top_p") is not None and not 0 < out["top_p"] <= 1:
        raise bad("top_p", f"must be in (0, 1], got {out['top_p']}")
    if body.get("top_k") is not None:
        k = body["top_k"]
        if isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1):
            raise bad("top_k", f"must be an integer >= 1, or -1 for none; got {k!r}")
        out["top_k"] = k
    out["stop_token_ids"] = _stop_ids(body, stop_id_of)
    return out


def _stop_ids(body: Dict[str, Any], stop_id_of) -> List[int]:
    ids = body.get("stop_token_ids") or []
    if isinstance(ids, int) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise bad("stop_token_ids", f"must be a list of token ids, got {ids!r}")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    out = list(ids)
    for s in stops:
        if isinstance(s, int) and not isinstance(s, bool):
            out.append(s)
            continue
        one = stop_id_of(s) if isinstance(s, str) else None
        if one is None:
            raise bad(
                "stop",
                f"{s!r} is not one token of the model's tokenizer; the engines stop on token ids, so a stop string must "
                "be a single token (e.g. '<|im_end|>'); stop on that token's id with stop_token_ids, or cut the text "
                "in the agent",
            )
        out.append(one)
    return sorted(set(out))


def text_of(content) -> str:
    """A message's content as text: a string, None (""), or OpenAI content parts (their texts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(p.get("text", "") for p in content)
    raise bad("messages", f"a message's content must be text (a string or text parts), got {content!r}")


def check_messages(messages) -> List[Dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad("messages", f"every message needs a role, got {m!r}")
    return messages


def tools_block(tools: Sequence[Dict[str, Any]]) -> str:
    """The tools described for a template that does not render them (module docstring)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou can call the functions below. Their signatures, one JSON object per line, are inside "
        f"<tools></tools>:\n<tools>\n{lines}\n</tools>\n\nTo call one, answer with a JSON object holding its name and "
        'arguments inside <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>"
    )


def with_tools_in_system(messages: List[Dict[str, Any]], tools) -> List[Dict[str, Any]]:
    block = tools_block(tools)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0], content=f"{text_of(messages[0].get('content'))}\n\n{block}")
        return [first] + list(messages[1:])
    return [{"role": "system", "content": block}] + list(messages)


def parse_tool_calls(text: str) -> Tuple[Optional[str], List[Dict[str, Any]]]:
    """``(content, tool_calls)`` of an answer's text (module docstring)."""
    calls, kept = [], text
    for m in TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
        )
        kept = kept.replace(m.group(0), "", 1)
    if not calls:
        return text, []
    kept = kept.strip()
    return (kept or None), calls


def usage(prompt_ids: Sequence[int], output_ids: Sequence[int]) -> Dict[str, int]:
    p, c = len(prompt_ids), len(output_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def chat_answer(
    content: Optional[str],
    tool_calls: List[Dict[str, Any]],
    finish_reason: str,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    log_probs: Sequence[float],
    token_texts: Sequence[str],
    *,
    want_logprobs: bool,
    want_prompt_ids: bool,
    model: str,
) -> Dict[str, Any]:
    """An OpenAI ``chat.completion`` object."""
    message: Dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice: Dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": "tool_calls" if tool_calls and finish_reason == "stop" else finish_reason,
        "logprobs": None,
        "token_ids": list(output_ids),
    }
    if want_logprobs:
        choice["logprobs"] = {
            "content": [
                {"token": t, "logprob": float(lp), "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                for t, lp in zip(token_texts, log_probs)
            ]
        }
    return _envelope("chatcmpl", "chat.completion", model, choice, prompt_ids, output_ids, want_prompt_ids)


def completion_answer(
    text: str,
    finish_reason: str,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    log_probs: Sequence[float],
    token_texts: Sequence[str],
    *,
    want_logprobs: bool,
    want_prompt_ids: bool,
    model: str,
) -> Dict[str, Any]:
    """An OpenAI ``text_completion`` object."""
    choice: Dict[str, Any] = {
        "index": 0,
        "text": text,
        "finish_reason": finish_reason,
        "logprobs": None,
        "token_ids": list(output_ids),
    }
    if want_logprobs:
        offsets, at = [], 0
        for t in token_texts:
            offsets.append(at)
            at += len(t)
        choice["logprobs"] = {
            "tokens": list(token_texts),
            "token_logprobs": [float(x) for x in log_probs],
            "top_logprobs": None,
            "text_offset": offsets,
        }
    return _envelope("cmpl", "text_completion", model, choice, prompt_ids, output_ids, want_prompt_ids)


def _envelope(id_prefix, kind, model, choice, prompt_ids, output_ids, want_prompt_ids) -> Dict[str, Any]:
    """The object around one choice: id, kind, time, model, ``usage`` (and the prompt ids on request)."""
    out = {
        "id": f"{id_prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(prompt_ids, output_ids),
    }
    if want_prompt_ids:
        out["prompt_token_ids"] = list(prompt_ids)
    return out
