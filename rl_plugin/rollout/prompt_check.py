"""Start-up check of a whole prompt file: every prompt tokenizes sanely, and fits the model's context.

Run once by ``rl-plugin-train`` before Ray starts (``rl_plugin.loop.preflight``), so a bad prompt
is named at start-up by file:line instead of failing (or training silently on a truncated
context) when its batch comes up. A sample is prompt + up to ``--rollout-max-response-len`` new
tokens, so the rule is::

    len(prompt_ids) + rollout_max_response_len <= max_position_embeddings

(the model's context, from its ``config.json``). A tokenization is sane when it gives integer ids
below the model's ``vocab_size`` and at least one id per ``MAX_CHARS_PER_TOKEN`` characters of the
prompt's text::

    len(prompt_ids) * MAX_CHARS_PER_TOKEN >= len(text)

(BPE tokenizers average 3-5 characters per token on English and code; a handful of ids from a
long text means the ids are not what the model reads, e.g. a tokenizer call that returned a
dict's keys). Cost: one tokenizer call per prompt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional, Tuple

from rl_plugin.arguments._util import RLArgumentError, fail
from rl_plugin.rollout.dataset import PromptRecord, is_parquet, read_prompts
from rl_plugin.rollout.tokenizer import PromptFormatError

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
    vocab_size: Optional[int] = None,
) -> int:
    """Raise ``RLArgumentError`` naming file:line of the first prompts that fail; returns the
    longest prompt in tokens."""
    try:
        records = read_prompts(path, input_key, label_key, metadata_key)
    except (ValueError, FileNotFoundError) as exc:
        raise RLArgumentError(f"{flag}: {exc}. Fix: correct that line of the file") from None
    too_long: List[Tuple[PromptRecord, int]] = []
    longest = 0
    for rec in records:
        try:
            ids = tokenizer.prompt_ids(rec.prompt)
        except PromptFormatError as exc:
            fail(f"{flag} {rec.where}", exc.rule, exc.fix)
        except Exception as exc:  # noqa: BLE001 - any tokenizer failure is this line's problem
            fail(
                f"{flag} {rec.where}",
                f"the tokenizer of --hf-checkpoint {hf_checkpoint} cannot encode this prompt "
                f"({type(exc).__name__}: {exc})",
                "remove or replace the characters it cannot encode, or use a tokenizer that covers them",
            )
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
