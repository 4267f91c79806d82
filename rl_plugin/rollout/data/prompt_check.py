"""Start-up check of a whole prompt file: every prompt tokenizes sanely, and fits the model's context
(``check_prompt_file``); for ``--loss-type sft_loss``, every conversation templates and fits
(``check_sft_file``).

Run once by ``rl-plugin-train`` before Ray starts (``rl_plugin.loop.preflight``), so a bad prompt
is named at start-up by file:line instead of failing (or training silently on a truncated
context) when its batch comes up. A sample is prompt + up to ``--rollout-max-response-len`` new
tokens, so the rule is::

    len(prompt_ids) + rollout_max_response_len <= max_position_embeddings

(the model's context, from its ``config.json``).

With a built-in reward that compares the response with the label (``--rm-type digit_match`` /
``math_exact``, ``rewards.LABEL_REWARDS``), every label must be a non-empty string or a finite
number (``check_labels``): a null or empty label scores 0 on every response, so a file of them
trains with reward 0 and gradient 0 and says nothing. A missing label key is refused by the
reader (``dataset.read_jsonl``). A ``--custom-rm-path`` function may take any label.

A chat prompt must not end in an assistant turn (``check_final_turn``): the generation prompt
comes after it, so the answer is in the prompt the model continues (reused SFT data); refused with
file:line unless ``answers_are_targets`` (the parameter the SFT loss, ``--loss-type sft_loss``
when it lands, sets: there the final assistant turn is the target, not part of the prompt).

When the tokenizer fails on a prompt while ``--apply-chat-template-kwargs`` are set and it
succeeds without them, the error names the kwargs, not the prompt (``_tokenizer_failure``).

A tokenization is sane when it gives integer ids
below the model's ``vocab_size`` and at least one id per ``MAX_CHARS_PER_TOKEN`` characters of the
prompt's text::

    len(prompt_ids) * MAX_CHARS_PER_TOKEN >= len(text)

(BPE tokenizers average 3-5 characters per token on English and code; a handful of ids from a
long text means the ids are not what the model reads, e.g. a tokenizer call that returned a
dict's keys). Cost: one tokenizer call per prompt.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import List, Optional, Tuple

from rl_plugin.errors import RLArgumentError, fail
from rl_plugin.rollout.data.dataset import PromptRecord, is_parquet, read_prompts
from rl_plugin.rollout.data.tokenizer import PromptFormatError
from rl_plugin.rollout.data.vl_sft import sft_example
from rl_plugin.rollout.rewards.functions import LABEL_REWARDS, is_number

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
SHOW = 3  # offending lines named in the message
MAX_CHARS_PER_TOKEN = 20  # far above any real tokenizer's average (3-5); below it the ids are wrong


def _config(hf_checkpoint) -> dict:
    cfg = json.loads((Path(hf_checkpoint) / "config.json").read_text())
    return {**cfg.get("text_config", {}), **cfg}


def model_vocab_size(hf_checkpoint) -> Optional[int]:
    """The model's vocabulary (embedding rows) from ``config.json`` (None when it names none)."""
    v = _config(hf_checkpoint).get("vocab_size")
    return v if isinstance(v, int) else None


def model_context_length(hf_checkpoint) -> Optional[int]:
    """The model's maximum sequence length from ``config.json`` (None when it names none)."""
    cfg = _config(hf_checkpoint)
    for key in CONTEXT_KEYS:
        if isinstance(cfg.get(key), int):
            return cfg[key]
    return None


def check_prompt_file(
    flag: str,
    path,
    tokenizer,
    *,
    input_key: str,
    label_key: Optional[str],
    metadata_key: Optional[str] = None,
    max_response_len: int,
    context_len: Optional[int],
    hf_checkpoint: str,
    rm_type: Optional[str] = None,
    vocab_size: Optional[int] = None,
    answers_are_targets: bool = False,
) -> int:
    """Raise ``RLArgumentError`` naming file:line of the first prompts (or labels, for
    ``rm_type``: ``check_labels``; or chats ending in an assistant turn: ``check_final_turn``)
    that fail; returns the longest prompt in tokens."""
    try:
        records = read_prompts(path, input_key, label_key, metadata_key)
    except (ValueError, FileNotFoundError) as exc:
        raise RLArgumentError(f"{flag}: {exc}. Fix: correct that line of the file") from None
    check_labels(flag, path, records, rm_type=rm_type, label_key=label_key)
    if not answers_are_targets:
        check_final_turn(flag, path, records)
    too_long: List[Tuple[PromptRecord, int]] = []
    longest = 0
    for rec in records:
        try:
            ids = tokenizer.prompt_ids(rec.prompt)
        except PromptFormatError as exc:
            fail(f"{flag} {rec.where}", exc.rule, exc.fix)
        except Exception as exc:  # noqa: BLE001 - any tokenizer failure is this line's problem (or the kwargs')
            fail(*_tokenizer_failure(flag, rec, tokenizer, exc, hf_checkpoint))
        n = len(ids)
        check_ids(flag, rec, ids, hf_checkpoint, vocab_size)
        longest = max(longest, n)
        if context_len is not None and n + max_response_len > context_len:
            too_long.append((rec, n))
    if too_long:
        first, n = too_long[0]
        unit = "rows" if is_parquet(path) else "lines"
        fits = context_len - max(k for _, k in too_long)
        shorter = f"lower --rollout-max-response-len to {fits}, " if fits >= 1 else ""
        more = f" ({len(too_long)} prompts in all, at {unit} {', '.join(str(r.lineno) for r, _ in too_long[:SHOW])}{', ...' if len(too_long) > SHOW else ''})"
        fail(
            f"{flag} {first.where}",
            f"the prompt is {n} tokens, and with --rollout-max-response-len {max_response_len} a sample can reach {n + max_response_len} "
            f"tokens, more than the {context_len} positions of the model (max_position_embeddings of --hf-checkpoint {hf_checkpoint}){more}",
            f"shorten or drop those prompts, {shorter}or use a model with a longer context",
        )
    return longest


def _tokenizer_failure(
    flag: str, rec: PromptRecord, tokenizer, exc: Exception, hf_checkpoint: str
) -> Tuple[str, str, str]:
    """The (flags, rule, fix) of a tokenizer failure: ``--apply-chat-template-kwargs`` when the same
    prompt encodes without them, else this prompt."""
    kwargs = getattr(tokenizer, "chat_template_kwargs", None)
    if kwargs:
        plain = copy.copy(tokenizer)
        plain.chat_template_kwargs = {}
        try:
            plain.prompt_ids(rec.prompt)
        except Exception:  # noqa: BLE001 - fails without them too: the prompt's problem
            pass
        else:
            return (
                f"--apply-chat-template-kwargs {json.dumps(kwargs)}",
                f"the chat template of --hf-checkpoint {hf_checkpoint} fails with these arguments "
                f"({type(exc).__name__}: {exc}) on {flag} {rec.where}, which it renders without them",
                "pass only the arguments the template reads, with the types it expects (see its chat_template.jinja)",
            )
    return (
        f"{flag} {rec.where}",
        f"the tokenizer of --hf-checkpoint {hf_checkpoint} cannot encode this prompt ({type(exc).__name__}: {exc})",
        "remove or replace the characters it cannot encode, or use a tokenizer that covers them",
    )


def check_final_turn(flag: str, path, records: List[PromptRecord]) -> None:
    """Refuse chats whose last message is the assistant's, naming file:line of the first ones."""
    bad = [rec for rec in records if not isinstance(rec.prompt, str) and rec.prompt[-1]["role"] == "assistant"]
    if not bad:
        return
    unit = "rows" if is_parquet(path) else "lines"
    at = ", ".join(str(r.lineno) for r in bad[:SHOW]) + (", ..." if len(bad) > SHOW else "")
    fail(
        f"{flag} {bad[0].where}",
        "the chat ends in an assistant turn, so its answer is part of the prompt the model continues (the generation "
        f"prompt comes after it: reused SFT data?) ({len(bad)} of {len(records)} prompts, at {unit} {at})",
        "drop the final assistant message of those chats (keep it as the label, --label-key, if the reward needs it)",
    )


def _label_problem(label) -> Optional[str]:
    """Why a built-in verifier cannot score against ``label`` (None: it can)."""
    if label is None:
        return "null"
    if isinstance(label, str):
        return None if label.strip() else "an empty string"
    if is_number(label):
        return None if math.isfinite(label) else f"the non-finite number {label}"
    return f"a JSON {type(label).__name__} ({label!r:.40})"


def check_labels(
    flag: str, path, records: List[PromptRecord], *, rm_type: Optional[str], label_key: Optional[str]
) -> None:
    """With a built-in reward that reads the label (``LABEL_REWARDS``), refuse a file whose labels
    are not all non-empty strings or finite numbers, naming file:line of the first ones."""
    if rm_type not in LABEL_REWARDS:
        return
    if not label_key:
        fail(
            f"--label-key {label_key!r} with --rm-type {rm_type}",
            f"no label is read from {flag} {path}, but {rm_type} compares each response with its label (every reward would be 0)",
            "name the label's key with --label-key (default 'label')",
        )
    bad = [(rec.lineno, why) for rec in records if (why := _label_problem(rec.label)) is not None]
    if not bad:
        return
    first_line, why = bad[0]
    lines = ", ".join(str(ln) for ln, _ in bad[:SHOW]) + (", ..." if len(bad) > SHOW else "")
    fail(
        f"{flag} {path}:{first_line}",
        f"the label ({label_key!r}, --label-key) is {why}, and --rm-type {rm_type} compares each response with its label, "
        f"so these samples would score 0 and train nothing ({len(bad)} of {len(records)} labels, at lines {lines}); "
        "labels must be non-empty strings or numbers",
        "fill in those labels or drop their lines, or score them with your own --custom-rm-path function",
    )


def check_ids(flag: str, rec: PromptRecord, ids: List[int], hf_checkpoint: str, vocab_size: Optional[int]) -> None:
    """A prompt's ids are sane: some ids, enough for its text, each inside the model's vocabulary."""
    text = rec.text
    bad = next((i for i in ids if type(i) is not int), None)  # noqa: E721 - bool and numpy ints are not ids here
    if bad is not None:
        fail(
            f"{flag} {rec.where}",
            f"the tokenizer of --hf-checkpoint {hf_checkpoint} returned {bad!r} ({type(bad).__name__}) among the token ids "
            f"of this prompt ({ids[:8]}); token ids are integers",
            "check the tokenizer files of the checkpoint and --apply-chat-template / --apply-chat-template-kwargs",
        )
    if not ids or len(ids) * MAX_CHARS_PER_TOKEN < len(text):
        fail(
            f"{flag} {rec.where}",
            f"the tokenizer of --hf-checkpoint {hf_checkpoint} gives {len(ids)} token ids ({ids[:8]}) for a prompt of "
            f"{len(text)} characters, fewer than one per {MAX_CHARS_PER_TOKEN} characters: these are not the tokens of "
            "the text (a tokenizer or chat-template call that returned something else than ids?)",
            "check the tokenizer files of the checkpoint and --apply-chat-template / --apply-chat-template-kwargs",
        )
    top = max(ids)
    if vocab_size is not None and (top >= vocab_size or min(ids) < 0):
        bad = top if top >= vocab_size else min(ids)
        fail(
            f"{flag} {rec.where}",
            f"the tokenizer gives token id {bad}, outside the model's vocabulary of {vocab_size} (vocab_size of "
            f"--hf-checkpoint {hf_checkpoint}): the tokenizer is not the model's",
            "use the tokenizer files that came with the model",
        )


def check_sft_file(
    flag: str,
    path,
    tokenizer,
    *,
    input_key: str,
    label_key: Optional[str],
    context_len: Optional[int],
    hf_checkpoint: str,
    image_key: Optional[str] = None,
) -> int:
    """``--loss-type sft_loss``: every record of ``path`` reads, templates (``vl_sft.sft_example``) and
    fits the model's context::

        len(conversation_ids) <= max_position_embeddings

    else ``RLArgumentError`` naming file:line (of the first too-long ones, with their count). A
    conversation is trained whole, never truncated: a cut one loses the end of its answer and the
    end-of-turn token, teaching the model not to stop (slime's SFT rollout, too, trains each
    conversation as the template renders it). ``image_key`` (``--multimodal-keys``): each record's
    images are opened and expanded by the processor (``vl_sft``), their tokens counted. Returns the
    longest conversation in tokens."""
    where = f"--loss-type sft_loss {flag}"
    try:
        records = read_prompts(path, input_key, label_key, label_optional=True, image_key=image_key)
        lengths = [len(sft_example(tokenizer, rec).ids) for rec in records]
    except (ValueError, FileNotFoundError) as exc:
        fail(where, str(exc), "correct that record of the file")
    too_long = [(rec, n) for rec, n in zip(records, lengths) if context_len is not None and n > context_len]
    if too_long:
        first, n = too_long[0]
        unit = "rows" if is_parquet(path) else "lines"
        at = ", ".join(str(r.lineno) for r, _ in too_long[:SHOW]) + (", ..." if len(too_long) > SHOW else "")
        fail(
            f"{where} {first.where}",
            f"the conversation is {n} tokens after the chat template, more than the {context_len} positions of the "
            f"model (max_position_embeddings of --hf-checkpoint {hf_checkpoint}) ({len(too_long)} of {len(records)} "
            f"conversations, at {unit} {at}); SFT trains a conversation whole, never truncated (a cut one loses the "
            "end of its answer and its end-of-turn token)",
            "shorten, split or drop those conversations, or use a model with a longer context",
        )
    return max(lengths)
