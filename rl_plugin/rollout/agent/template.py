"""The model's tokenizer and chat template as the agent endpoint uses them: render a chat to text,
tokenise it (the template's own ids), tokenise a piece, decode with and without special tokens.

The template is the checkpoint's own, with ``--apply-chat-template-kwargs`` (e.g.
``enable_thinking``) and the generation prompt added; ``tools`` reach it as the ``tools`` argument
when the template reads them, else as a system-message block (``chat.with_tools_in_system``).

Which templates are append-only (a turn's text starts with the previous turn's text followed by
the model's answer, ``sessions``), for the families the project supports — pinned by
``tests/fast/rollout/agent/test_records.py``:

- ChatML as SmolLM2 writes it (``<|im_start|>role\\ncontent<|im_end|>\\n``; also the tiny chat
  model's): append-only, including tool turns (``role: tool``) and tools in the system message;
- Qwen2 / Qwen2.5 ChatML (renders ``tools`` and ``tool_calls`` itself): append-only by the same
  rule when the assistant turns are sent back as this endpoint answered them (their raw text is
  re-rendered, ``sessions.Session.raw_messages``) and its ``<tool_response>`` wrapping of tool
  messages is appended text — reasoned from the template, not tested here (no Qwen2 tokenizer on
  the test machine); a turn that breaks it is counted, never mis-trained;
- templates that re-render earlier turns — Qwen3's drops the ``<think>`` block of earlier
  assistant turns, Llama-3.1's puts the date into the system turn — are not: their turns become
  separate samples (``agent/non_append_turns``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from rl_plugin.rollout.agent.chat import RequestError, with_tools_in_system
from rl_plugin.rollout.data.tokenizer import HFTokenizerAdapter, as_ids


class ChatTemplate:
    """A Hugging Face tokenizer ``tok`` and its template (module docstring)."""

    def __init__(self, tok, chat_template_kwargs: Optional[Dict[str, Any]] = None):
        self.tok = tok
        self.kwargs = dict(chat_template_kwargs or {})
        template = getattr(tok, "chat_template", None) or ""
        self.has_template = bool(template)
        self.renders_tools = "tools" in template
        eos = tok.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}

    def _chat(self, messages: List[Dict[str, Any]], tools) -> Dict[str, Any]:
        if not self.has_template:
            raise RequestError(
                400,
                "messages: the checkpoint's tokenizer has no chat template; use /v1/completions with a prompt, or a "
                "checkpoint with a chat_template",
                "messages",
            )
        if tools and not self.renders_tools:
            messages = with_tools_in_system(messages, tools)
        kw = dict(self.kwargs)
        if tools and self.renders_tools:
            kw["tools"] = list(tools)
        return {"conversation": messages, "add_generation_prompt": True, **kw}

    def render(self, messages: List[Dict[str, Any]], tools=None) -> str:
        try:
            return self.tok.apply_chat_template(tokenize=False, **self._chat(messages, tools))
        except RequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
            raise RequestError(400, f"messages: the chat template refused them: {exc}", "messages") from None

    def template_ids(self, messages: List[Dict[str, Any]], tools=None) -> List[int]:
        """The template's own tokenisation (``apply_chat_template(tokenize=True)``)."""
        out = self.tok.apply_chat_template(tokenize=True, return_dict=False, **self._chat(messages, tools))
        return as_ids(out, "the tokenizer's apply_chat_template")

    def encode(self, text: str, special: bool = False) -> List[int]:
        return as_ids(self.tok(text, add_special_tokens=special)["input_ids"], "the tokenizer")

    def decode(self, ids: Sequence[int], keep_special: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=not keep_special)

    def token_texts(self, ids: Sequence[int]) -> List[str]:
        return [self.tok.decode([i]) for i in ids]

    def stop_id_of(self, text: str) -> Optional[int]:
        """The id of ``text`` when it is exactly one token, else None."""
        ids = self.encode(text)
        return ids[0] if len(ids) == 1 else None

    def answer_ids(self, output_ids: Sequence[int], finish_reason: str) -> List[int]:
        """The output ids without the stop id that ended them (what ``content`` shows)."""
        ids = list(output_ids)
        return ids[:-1] if finish_reason == "stop" and ids else ids


class AgentPrompts:
    """The run's tokenizer as an agent rollout reads the dataset's prompts (``fresh_samples``):
    a string as the run's tokenizer shows it (the text after the template with
    ``--apply-chat-template``, the string itself without), a list of chat messages rendered by the
    checkpoint's chat template with or without the flag: the agent is handed the messages as they
    are, and the endpoint renders every chat with that template, so ``sample.prompt`` is the text
    the agent's first request becomes."""

    def __init__(self, tokenizer):
        self.plain = tokenizer
        self.chat = tokenizer
        if not tokenizer.apply_chat_template and getattr(tokenizer.tok, "chat_template", None):
            self.chat = HFTokenizerAdapter(tokenizer.tok, True, tokenizer.chat_template_kwargs, tokenizer.system_prompt)

    def _of(self, prompt):
        return self.plain if isinstance(prompt, str) else self.chat

    def prompt_ids(self, prompt) -> List[int]:
        return self._of(prompt).prompt_ids(prompt)

    def prompt_text(self, prompt) -> str:
        return self._of(prompt).prompt_text(prompt)

    def decode(self, ids: Sequence[int]) -> str:
        return self.plain.decode(ids)
