"""Start-up check of a whole prompt file: every prompt tokenizes, and fits the model's context.

Run once by ``rl-plugin-train`` before Ray starts (``rl_plugin.loop.preflight``), so a bad prompt
is named at start-up by file:line instead of failing (or training silently on a truncated
context) when its batch comes up. A sample is prompt + up to ``--rollout-max-response-len`` new
tokens, so the rule is::

    len(prompt_ids) + rollout_max_response_len <= max_position_embeddings

(the model's context, from its ``config.json``). Cost: one tokenizer call per prompt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional, Tuple

from rl_plugin.errors import RLArgumentError, fail
from rl_plugin.rollout.dataset import read_jsonl

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
SHOW = 3  # offending lines named in the message


def model_context_length(hf_checkpoint) -> Optional[int]:
    """The model's maximum sequence length from ``config.json`` (None when it names none)."""
    cfg = json.loads((Path(hf_checkpoint) / "config.json").read_text())
    cfg = {**cfg.get("text_config", {}), **cfg}
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
    max_response_len: int,
    context_len: Optional[int],
    hf_checkpoint: str,
) -> int:
    """Raise ``RLArgumentError`` naming file:line of the first prompts that fail; returns the
    longest prompt in tokens."""
    try:
        records = read_jsonl(path, input_key, label_key)
    except (ValueError, FileNotFoundError) as exc:
        raise RLArgumentError(f"{flag}: {exc}. Fix: correct that line of the file") from None
    too_long: List[Tuple[int, int]] = []
    longest = 0
    for rec in records:
        try:
            n = len(tokenizer.prompt_ids(rec.prompt))
        except Exception as exc:  # noqa: BLE001 - any tokenizer failure is this line's problem
            fail(
                f"{flag} {path}:{rec.lineno}",
                f"the tokenizer of --hf-checkpoint {hf_checkpoint} cannot encode this prompt "
                f"({type(exc).__name__}: {exc})",
                "remove or replace the characters it cannot encode, or use a tokenizer that covers them",
            )
        longest = max(longest, n)
        if context_len is not None and n + max_response_len > context_len:
            too_long.append((rec.lineno, n))
    if too_long:
        first_line, n = too_long[0]
        fits = context_len - max(k for _, k in too_long)
        shorter = f"lower --rollout-max-response-len to {fits}, " if fits >= 1 else ""
        more = f" ({len(too_long)} prompts in all, at lines {', '.join(str(ln) for ln, _ in too_long[:SHOW])}{', ...' if len(too_long) > SHOW else ''})"
        fail(
            f"{flag} {path}:{first_line}",
            f"the prompt is {n} tokens, and with --rollout-max-response-len {max_response_len} a sample can reach {n + max_response_len} "
            f"tokens, more than the {context_len} positions of the model (max_position_embeddings of --hf-checkpoint {hf_checkpoint}){more}",
            f"shorten or drop those prompts, {shorter}or use a model with a longer context",
        )
    return longest
