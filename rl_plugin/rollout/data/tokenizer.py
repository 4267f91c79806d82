"""A character tokenizer for the embedded tiny model (no model hub, no tokenizer files needed).

Ids 0..3 are ``<pad> <bos> <eos> <sep>`` (matching ``rl_plugin.models.tiny``: pad 0, bos 1, eos 2);
then one id per character of ``alphabet``. It is saved beside the tiny checkpoint as
``char_tokenizer.json`` so the rollout engine and any later run decode the same way; a real
checkpoint brings its own Hugging Face tokenizer instead (``load_tokenizer``).
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from rl_plugin.rollout.data.tool_calls import with_tool_calls_rendered

SPECIALS = ("<pad>", "<bos>", "<eos>", "<sep>")
FILENAME = "char_tokenizer.json"


class CharTokenizer:
    pad_token_id, bos_token_id, eos_token_id, sep_token_id = 0, 1, 2, 3

    def __init__(self, alphabet: str):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"CharTokenizer alphabet has repeated characters: {alphabet!r}")
        self.alphabet = alphabet
        self._ids = {c: i + len(SPECIALS) for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + len(self.alphabet)

    def encode(self, text: str) -> List[int]:
        """Characters to ids; ``=`` maps to ``<sep>`` when it is not in the alphabet."""
        out = []
        for pos, c in enumerate(text):
            if c in self._ids:
                out.append(self._ids[c])
            elif c == "=":
                out.append(self.sep_token_id)
            else:
                raise ValueError(
                    f"character {c!r} at position {pos} of {text!r} is not in the tokenizer alphabet {self.alphabet!r}"
                )
        return out

    def prompt_ids(self, text: str) -> List[int]:
        """A prompt as the model sees it: ``<bos>`` + characters."""
        if not isinstance(text, str):
            raise PromptFormatError(
                "the prompt is a list of chat messages, and the checkpoint's character tokenizer has no chat template",
                "give the prompt as a string",
            )
        return [self.bos_token_id] + self.encode(text)

    def prompt_text(self, text: str) -> str:
        """The prompt as text (a custom generate hook's ``sample.prompt``): the string itself."""
        self.prompt_ids(text)  # the same checks
        return text

    def decode(self, ids: Sequence[int]) -> str:
        """Ids to text; generation stops at ``<eos>``, other specials are dropped."""
        chars = []
        for i in ids:
            i = int(i)
            if i == self.eos_token_id:
                break
            if i >= len(SPECIALS) and i - len(SPECIALS) < len(self.alphabet):
                chars.append(self.alphabet[i - len(SPECIALS)])
            elif i == self.sep_token_id:
                chars.append("=")
        return "".join(chars)

    def save(self, directory) -> Path:
        path = Path(directory) / FILENAME
        path.write_text(json.dumps({"type": "char", "specials": list(SPECIALS), "alphabet": self.alphabet}))
        return path

    @classmethod
    def load(cls, directory) -> "CharTokenizer":
        data = json.loads((Path(directory) / FILENAME).read_text())
        return cls(data["alphabet"])


class PromptFormatError(ValueError):
    """A prompt the tokenizer settings cannot turn into ids (e.g. chat messages without
    ``--apply-chat-template``); ``rule`` says what is wrong, ``fix`` which flag fixes it."""

    def __init__(self, rule: str, fix: str):
        super().__init__(f"{rule}. Fix: {fix}")
        self.rule, self.fix = rule, fix


def as_ids(out, what: str) -> List[int]:
    """Token ids as a flat list of Python ints, whatever ``apply_chat_template`` / ``__call__``
    returned: transformers 5.x gives a ``BatchEncoding`` from ``apply_chat_template(tokenize=True)``
    unless ``return_dict=False`` (iterating it yields the *keys* ``input_ids``, ``attention_mask``),
    some versions a tensor or a batch of one. Anything that is not integer ids raises."""
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    out = list(out)
    if len(out) == 1 and isinstance(out[0], (list, tuple)):
        out = list(out[0])
    bad = next((i for i in out if isinstance(i, bool) or not isinstance(i, numbers.Integral)), None)
    if bad is not None:
        raise TypeError(f"{what} returned {bad!r} ({type(bad).__name__}) among the token ids; expected integers")
    return [int(i) for i in out]


class HFTokenizerAdapter:
    """A Hugging Face tokenizer behind the same small interface (``prompt_ids``, ``decode``).

    Without a chat template a prompt must be a string and is encoded with the tokenizer's special
    tokens (e.g. BOS). With ``apply_chat_template`` a string becomes one user turn, a message list
    is used as it is; ``system_prompt`` adds a system turn first unless the messages begin with
    one; ``chat_template_kwargs`` (``--apply-chat-template-kwargs``, e.g. ``enable_thinking``) are
    passed to the template, and the generation prompt is always added."""

    def __init__(
        self,
        tok,
        apply_chat_template: bool = False,
        chat_template_kwargs: Optional[Dict[str, Any]] = None,
        system_prompt: Optional[str] = None,
    ):
        self.tok = tok
        self.apply_chat_template = apply_chat_template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.system_prompt = system_prompt
        self.eos_token_id = tok.eos_token_id
        self.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def messages(self, prompt) -> List[Dict[str, Any]]:
        """The chat the template renders for ``prompt`` (a string or a message list); assistant
        ``tool_calls`` written into the content when the template does not read them
        (``rl_plugin.rollout.data.tool_calls``)."""
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.system_prompt is not None and msgs[0]["role"] != "system":
            msgs = [{"role": "system", "content": self.system_prompt}] + msgs
        return with_tool_calls_rendered(msgs, "tool_calls" in (getattr(self.tok, "chat_template", None) or ""))

    def end_of_turn_ids(self) -> Optional[List[int]]:
        """The token(s) the chat template closes an assistant turn with (ChatML's ``<|im_end|>``,
        Llama 3's ``<|eot_id|>``, Gemma's ``<end_of_turn>``), read from the template, not the
        tokenizer's EOS (Qwen2.5 / Qwen3 base tokenizers' EOS is ``<|endoftext|>`` while their
        template ends turns with ``<|im_end|>``). A probe chat ``[user, assistant: PROBE]`` is
        rendered as text; what follows the probe's content, trailing whitespace stripped, is the
        terminator, tokenised. None when the template writes nothing but whitespace after an
        answer, or the probe's content is not found in its render (cached per adapter)."""
        if not hasattr(self, "_end_of_turn"):
            probe = "Probe answer 7"
            chat = self.messages(
                [{"role": "user", "content": "Probe question"}, {"role": "assistant", "content": probe}]
            )
            text = self.tok.apply_chat_template(chat, tokenize=False, **self.chat_template_kwargs)
            at = text.rfind(probe) if isinstance(text, str) else -1
            tail = text[at + len(probe) :].rstrip() if at >= 0 else ""
            ids = as_ids(self.tok(tail, add_special_tokens=False)["input_ids"], "the tokenizer") if tail else []
            self._end_of_turn = ids or None
        return self._end_of_turn

    def prompt_ids(self, prompt) -> List[int]:
        if self.apply_chat_template:
            out = self.tok.apply_chat_template(
                self.messages(prompt),
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
                **self.chat_template_kwargs,
            )
            return as_ids(out, "the tokenizer's apply_chat_template")
        if not isinstance(prompt, str):
            raise PromptFormatError(
                "the prompt is a list of chat messages, which only a chat template turns into tokens",
                "pass --apply-chat-template (or give the prompt as a string)",
            )
        return as_ids(self.tok(prompt, add_special_tokens=True)["input_ids"], "the tokenizer")

    def prompt_text(self, prompt) -> str:
        """The prompt as text after the chat template (a custom generate hook's ``sample.prompt``);
        without a template, the string itself."""
        if self.apply_chat_template:
            return self.tok.apply_chat_template(
                self.messages(prompt), add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs
            )
        self.prompt_ids(prompt)  # the same checks
        return prompt

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(
    checkpoint_dir,
    *,
    apply_chat_template: bool = False,
    chat_template_kwargs: Optional[Dict[str, Any]] = None,
    system_prompt: Optional[str] = None,
):
    """The char tokenizer when the checkpoint carries one, else its Hugging Face tokenizer."""
    if (Path(checkpoint_dir) / FILENAME).exists():
        if apply_chat_template:
            raise ValueError(
                f"--apply-chat-template: the checkpoint {checkpoint_dir} has a character tokenizer with no chat template; drop the flag"
            )
        return CharTokenizer.load(checkpoint_dir)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(checkpoint_dir))
    except Exception as exc:  # noqa: BLE001 - re-raised with the path named
        raise ValueError(
            f"--hf-checkpoint {checkpoint_dir}: no tokenizer found ({FILENAME} or Hugging Face tokenizer files): {exc}"
        ) from exc
    if apply_chat_template and not getattr(tok, "chat_template", None):
        raise ValueError(
            f"--apply-chat-template: the tokenizer of {checkpoint_dir} has no chat template (a base model?); "
            "drop the flag, or add a chat_template.jinja to the checkpoint"
        )
    return HFTokenizerAdapter(tok, apply_chat_template, chat_template_kwargs, system_prompt)


def rollout_tokenizer(config, checkpoint_dir):
    """``checkpoint_dir``'s tokenizer with the rollout config's chat-template settings
    (``--apply-chat-template``, ``--apply-chat-template-kwargs``, ``--system-prompt``): the one the
    rollout side, the SFT data and the preflight's file checks all template with (a run with
    images: ``vl_prompt.rollout_prompts``)."""
    return load_tokenizer(
        checkpoint_dir,
        apply_chat_template=config.apply_chat_template,
        chat_template_kwargs=config.apply_chat_template_kwargs,
        system_prompt=config.system_prompt,
    )
