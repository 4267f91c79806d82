"""SFT conversations as token ids and a loss mask (``--loss-type sft_loss``).

A record of ``--prompt-data`` (``dataset.read_prompts``) becomes one conversation:

- chat ``messages`` under ``--input-key`` (system / user / assistant / tool turns; at least one
  assistant turn, none empty; an assistant turn's OpenAI ``tool_calls`` are trained as the template
  renders them, in the agent endpoint's Hermes form when it ignores them:
  ``rl_plugin.rollout.data.tool_calls``), with, when ``--label-key`` names a string, that string
  appended as one more assistant turn;
- a prompt string under ``--input-key`` and its completion under ``--label-key``: the chat
  ``[user: prompt, assistant: completion]``.

Templated once (HF tokenizers, ``--apply-chat-template``): the whole conversation is rendered ONCE
by the tokenizer's chat template (``--system-prompt`` and ``--apply-chat-template-kwargs`` as for
RL prompts), and the loss mask is 1 on the assistant turns' tokens only. For assistant turn i the
trained span is ``[len(render(turns < i, add_generation_prompt=True)),
len(render(turns <= i)))`` cut after its last end-of-turn token(s), read from the template
(``HFTokenizerAdapter.end_of_turn_ids``: ChatML's ``<|im_end|>``, whatever the tokenizer's EOS;
the EOS only when the template writes no terminator). So the span is the assistant's content AND its end-of-turn token (the model learns
to stop: at generation the engine stops on that token), but NOT the ``<|im_start|>assistant\\n``
header (the template writes it, the model never has to: it is the generation prompt an RL rollout
starts from) and NOT the newline the template writes after ``<|im_end|>`` (the engine stops before
it). Each prefix render must be a token prefix of the whole conversation's ids; a template that
rewrites earlier turns (e.g. one that drops the reasoning of past assistant turns) is not
prefix-stable and is refused naming the sample, never trained on silently misaligned masks.

Character tokenizer (the embedded tiny model, no template): prompt + completion pairs only;
``<bos> prompt`` is conditioned on and ``completion <eos>`` is trained.

A conversation is one sample of the loss core's layout: its "prompt" is everything before its first
trained token, its "response" the rest (later user turns inside it carry mask 0, like a tool turn a
custom generate hook appended).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

from rl_plugin.rollout.data.dataset import Messages, PromptRecord, check_messages
from rl_plugin.rollout.data.tokenizer import CharTokenizer, as_ids

_IDS, _MASK = attrgetter("ids"), attrgetter("mask")


@dataclass
class SftExample:
    """One templated conversation: ``ids`` (``[T]``) and ``mask`` (1 on trained tokens, ``[T]``);
    with images (``vl_sft``) their processed ``pixel_values`` ``[patches, C*T*P*P]`` and
    ``image_grid_thw`` ``[images, 3]``."""

    ids: List[int]
    mask: List[int]
    where: str
    pixel_values: Optional[torch.Tensor] = None
    image_grid_thw: Optional[torch.Tensor] = None

    @property
    def prompt_length(self) -> int:
        """Tokens before the first trained one (the loss core's prompt)."""
        return self.mask.index(1)


def conversation(record: PromptRecord) -> Messages:
    """The chat a record holds (module docstring); raises naming the record when it has no
    assistant turn to train on, or an empty one (no content, no ``tool_calls``: it would train the
    end-of-turn token alone, i.e. to answer nothing)."""
    where = record.where or f"record {record.index}"
    label = record.label
    if isinstance(record.prompt, str):
        if not isinstance(label, str) or not label:
            raise ValueError(
                f"{where}: --loss-type sft_loss with a prompt string needs its completion under --label-key "
                f"(got {label!r}). Fix: add the completion, or give a chat 'messages' list with assistant turns"
            )
        return [{"role": "user", "content": record.prompt}, {"role": "assistant", "content": label}]
    msgs = list(record.prompt)
    if isinstance(label, str) and label:
        msgs.append({"role": "assistant", "content": label})
    msgs = check_messages(where, "messages", msgs, parts=record.images is not None)  # images: content parts
    if not any(m["role"] == "assistant" for m in msgs):
        raise ValueError(
            f"{where}: the conversation has no assistant turn, so SFT has no token to train on. "
            "Fix: add the assistant's answer (a message with role 'assistant', or a --label-key completion)"
        )
    blank = (
        j
        for j, m in enumerate(msgs)
        if m["role"] == "assistant" and not (_has_content(m["content"]) or m.get("tool_calls"))
    )
    empty = next(blank, None)
    if empty is not None:
        raise ValueError(
            f"{where}: message {empty} is an assistant turn with no content and no tool_calls, so SFT would train "
            "its end-of-turn token alone (the model learns to answer nothing). Fix: fill in the answer (or its "
            "tool_calls), or drop the turn"
        )
    return msgs


def _has_content(content) -> bool:
    """A message's content is not blank (a string, or a list of content parts)."""
    return bool(content.strip()) if isinstance(content, str) else bool(content)


def _is_prefix(prefix: Sequence[int], ids: Sequence[int]) -> bool:
    return len(prefix) <= len(ids) and list(ids[: len(prefix)]) == list(prefix)


Render = Callable[[Messages, bool], List[int]]  # (turns, add_generation_prompt) -> ids


def chat_example(adapter, messages: Messages, where: str, render: Optional[Render] = None) -> SftExample:
    """The ids of ``messages`` rendered once by ``adapter``'s chat template (an
    ``HFTokenizerAdapter``) and the assistant-span mask (module docstring); ``render``: how turns
    become ids (default: the tokenizer's template; a conversation with images: ``vl_sft``'s)."""
    tok, kw = adapter.tok, adapter.chat_template_kwargs
    msgs = adapter.messages(messages)  # --system-prompt added when the chat has no system turn

    def text_render(turns, gen: bool) -> List[int]:
        out = tok.apply_chat_template(turns, add_generation_prompt=gen, tokenize=True, return_dict=False, **kw)
        return as_ids(out, "the tokenizer's apply_chat_template")

    render = render or text_render

    ids = render(msgs, False)
    mask = [0] * len(ids)
    end = adapter.end_of_turn_ids()
    terminator = end if end is not None else [adapter.eos_token_id] if adapter.eos_token_id is not None else []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before, through = render(msgs[:i], True) if i else [], render(msgs[: i + 1], False)
        for name, part in (("the turns before it plus the generation prompt", before), ("the turns up to it", through)):
            if not _is_prefix(part, ids):
                raise ValueError(
                    f"{where}: the chat template is not prefix-stable at assistant turn {i}: rendering {name} does "
                    "not give a token prefix of the whole conversation (the template rewrites earlier turns, e.g. "
                    "drops past reasoning), so the assistant tokens cannot be located. Fix: use a template that "
                    "renders each turn the same whatever follows, or split the conversation at this turn"
                )
        start, stop = len(before), len(through)
        stop = start + _through_last(ids[start:stop], terminator)  # cut after the end-of-turn token(s) (docstring)
        if stop <= start:
            raise ValueError(f"{where}: assistant turn {i} renders to no token after the template's header")
        mask[start:stop] = [1] * (stop - start)
    return SftExample(ids, mask, where)


def _through_last(span: Sequence[int], terminator: Sequence[int]) -> int:
    """The length of ``span`` up to and including the last occurrence of ``terminator`` (the
    whole span when it holds none)."""
    n = len(terminator)
    for at in range(len(span) - n, -1, -1) if n else ():
        if list(span[at : at + n]) == list(terminator):
            return at + n
    return len(span)


def char_example(tok: CharTokenizer, record: PromptRecord) -> SftExample:
    """A prompt + completion pair for the character tokenizer: ``<bos> prompt | completion <eos>``."""
    where = record.where or f"record {record.index}"
    if not isinstance(record.prompt, str) or not isinstance(record.label, str) or not record.label:
        raise ValueError(
            f"{where}: the checkpoint's character tokenizer has no chat template, so SFT needs a prompt string "
            "(--input-key) and its completion string (--label-key)"
        )
    prompt = tok.prompt_ids(record.prompt)
    completion = tok.encode(record.label) + [tok.eos_token_id]
    return SftExample(prompt + completion, [0] * len(prompt) + [1] * len(completion), where)


def example_of(tokenizer, record: PromptRecord) -> SftExample:
    """One record as a templated, masked conversation (either tokenizer; a record with images:
    ``vl_sft.sft_example``, which calls this for the text-only ones)."""
    if isinstance(tokenizer, CharTokenizer):
        return char_example(tokenizer, record)
    where = record.where or f"record {record.index}"
    if not tokenizer.apply_chat_template:
        raise ValueError(
            f"{where}: --loss-type sft_loss templates the conversation with the tokenizer's chat template. "
            "Fix: pass --apply-chat-template"
        )
    return chat_example(tokenizer, conversation(record), where)


def sft_tensors(examples: Sequence[SftExample]) -> Dict[str, torch.Tensor]:
    """The loss core's flat layout of ``examples`` (one sample each): ``tokens`` ``[sum T_i]``,
    ``total_lengths`` / ``response_lengths`` ``[S]``, ``loss_mask`` ``[sum R_i]`` fp32, where a
    sample's response starts at its first trained token; with images ``pixel_values``,
    ``image_grid_thw`` and ``image_counts`` ``[S]``. C-level passes (``chain``,
    ``numpy.fromiter``), no Python loop over tokens."""
    n = len(examples)
    total = np.fromiter(map(len, map(_IDS, examples)), np.int64, n)
    starts = np.fromiter((e.prompt_length for e in examples), np.int64, n)
    tokens = np.fromiter(chain.from_iterable(map(_IDS, examples)), np.int64, int(total.sum()))
    mask = np.fromiter(chain.from_iterable(map(_MASK, examples)), np.float32, int(total.sum()))
    offsets = np.cumsum(total) - total
    position = np.arange(mask.shape[0]) - np.repeat(offsets, total)  # each token's index in its sample
    keep = position >= np.repeat(starts, total)  # the response: from the first trained token on
    out = {
        "tokens": torch.from_numpy(tokens),
        "total_lengths": torch.from_numpy(total),
        "response_lengths": torch.from_numpy(total - starts),
        "loss_mask": torch.from_numpy(np.ascontiguousarray(mask[keep])),
    }
    with_images = [e for e in examples if e.image_grid_thw is not None]
    if with_images:  # loss.batch's image layout: every image in sample order, a count per sample
        out["pixel_values"] = torch.cat([e.pixel_values for e in with_images])
        out["image_grid_thw"] = torch.cat([e.image_grid_thw for e in with_images])
        counts = (0 if e.image_grid_thw is None else e.image_grid_thw.shape[0] for e in examples)
        out["image_counts"] = torch.tensor(list(counts), dtype=torch.long)
    return out
