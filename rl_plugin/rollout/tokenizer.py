"""A character tokenizer for the embedded tiny model (no model hub, no tokenizer files needed).

Ids 0..3 are ``<pad> <bos> <eos> <sep>`` (matching ``rl_plugin.models.tiny``: pad 0, bos 1, eos 2);
then one id per character of ``alphabet``. It is saved beside the tiny checkpoint as
``char_tokenizer.json`` so the rollout engine and any later run decode the same way; a real
checkpoint brings its own Hugging Face tokenizer instead (``load_tokenizer``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Sequence

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
        return [self.bos_token_id] + self.encode(text)

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


class HFTokenizerAdapter:
    """A Hugging Face tokenizer behind the same small interface (``prompt_ids``, ``decode``)."""

    def __init__(self, tok, apply_chat_template: bool = False):
        self.tok = tok
        self.apply_chat_template = apply_chat_template
        self.eos_token_id = tok.eos_token_id
        self.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def prompt_ids(self, text: str) -> List[int]:
        if self.apply_chat_template:
            return list(
                self.tok.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
                )
            )
        return list(self.tok(text, add_special_tokens=True)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(checkpoint_dir, *, apply_chat_template: bool = False):
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
    return HFTokenizerAdapter(tok, apply_chat_template)
