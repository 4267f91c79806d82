"""Prompt datasets from JSONL or Parquet (``--prompt-data``, ``--input-key``, ``--label-key``,
``--metadata-key``), with a resumable position.

The dataset is read once. A file whose name ends in ``.parquet`` is read with pyarrow (one record
per row, named ``file row N`` in messages); any other file is JSONL (one JSON object per line,
named ``file:line``, UTF-8; lines of whitespace only hold no record and are skipped, a trailing newline
is common in JSONL tools). Every record holds under the input key either

- a non-empty prompt string, or
- a chat as a non-empty list of ``{"role": str, "content": str}`` messages (slime's and verl's
  convention, e.g. a system and a user turn; roles from ``KNOWN_ROLES``, content one string; an
  assistant turn may carry OpenAI ``tool_calls``, ``rl_plugin.rollout.data.tool_calls``),
  which needs ``--apply-chat-template``;

and the label key (when one is configured), and the metadata key (when one is configured: a JSON
object, handed to a reward function that takes ``metadata``). With ``--multimodal-keys`` a record
holds its images under the image key (``rl_plugin.rollout.data.images``), and a chat message's
content may be a list of parts (``{"type": "text", "text": ...}``, ``{"type": "image"}``, OpenAI's
``image_url``), one image part per image, in order. A bad record raises naming where it
is. Batches are taken in order, wrapping around into a new epoch (reshuffled with
``seed + epoch`` when ``shuffle``), so the position is just ``(epoch, offset)`` and
``state_dict`` / ``load_state_dict`` restore it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

from rl_plugin.rollout.data.images import record_images
from rl_plugin.rollout.data.tool_calls import normalise as normalise_tool_calls

Messages = List[Dict[str, Any]]  # role, content (and an assistant turn's tool_calls)
Prompt = Union[str, Messages]


@dataclass
class PromptRecord:
    prompt: Prompt  # the text, or the chat messages
    label: Any
    index: int  # record index in the file (0-based; blank lines are skipped)
    lineno: int = 0  # line (JSONL) or row (Parquet) number in the file (1-based), for messages
    metadata: Optional[Dict[str, Any]] = None  # the --metadata-key object, when configured
    where: str = ""  # "file:line" (JSONL) or "file row N" (Parquet), for messages
    images: Optional[List[Any]] = None  # --multimodal-keys: the record's image references (``images``)

    @property
    def text(self) -> str:
        """The prompt's text: the string, or the messages' contents joined by newlines."""
        if isinstance(self.prompt, str):
            return self.prompt
        return "\n".join(_text_of(m["content"]) for m in self.prompt)


def _text_of(content) -> str:
    """A message's text: the string, or its text parts joined."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")


IMAGE_PARTS = ("image", "image_url")  # a content part that stands for one of the record's images


def is_parquet(path) -> bool:
    return str(path).endswith(".parquet")


def _jsonl_rows(path: Path) -> Iterator[Tuple[str, int, Any]]:
    """Read as bytes and decoded line by line, so a line that is not UTF-8 is named by its line."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); JSONL is "
                    "UTF-8. Fix: re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8), or drop that line"
                ) from None
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None


def _parquet_rows(path: Path) -> Iterator[Tuple[str, int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"{path}: reading .parquet needs the pyarrow package (pip install pyarrow, or convert the file to JSONL)"
        ) from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # noqa: BLE001 - pyarrow's own errors (ArrowInvalid, ...) name no flag
        raise ValueError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    for i, row in enumerate(rows, 1):
        yield f"{path} row {i}", i, row


# The chat roles templates know (OpenAI's, plus the tool-call roles of Llama 3.1 and older OpenAI).
# Another role is refused: templates drop it silently or render it as free text.
KNOWN_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")


def check_messages(where: str, key: str, messages: Any, parts: bool = False) -> Messages:
    """A chat must be a non-empty list of {"role": str, "content": str} with some content, each
    role one of ``KNOWN_ROLES``; OpenAI's content parts (a list of {"type": "text", ...}) are
    refused saying so, unless ``parts`` (a record with images: text and image parts)."""
    if not messages:
        raise ValueError(f"{where}: {key!r} is an empty list of messages; the model needs a prompt to answer")
    messages = [normalise_tool_calls(where, key, j, m) if isinstance(m, dict) else m for j, m in enumerate(messages)]
    for j, m in enumerate(messages):
        if parts and isinstance(m, dict) and isinstance(m.get("content"), list):
            m["content"] = _check_parts(where, key, j, m["content"])
        elif isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), list):
            raise ValueError(
                f"{where}: message {j} of {key!r} gives its content as a list of parts (OpenAI's multi-part form), which "
                "rl_plugin does not support (text-only chat templates render one string per message). Fix: give "
                "'content' as one string (join the text parts)"
            )
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), (str, list))
        ):
            raise ValueError(
                f"{where}: message {j} of {key!r} must be an object with string 'role' and 'content' "
                f'(e.g. {{"role": "user", "content": "What is 2 + 3?"}}), got {m!r}'
            )
        if not m["role"]:
            raise ValueError(f"{where}: message {j} of {key!r} has an empty 'role'")
        if m["role"] not in KNOWN_ROLES:
            raise ValueError(
                f"{where}: message {j} of {key!r} has the role {m['role']!r}, which chat templates do not know (they "
                f"drop it or render it as plain text). Fix: use one of {', '.join(KNOWN_ROLES)}"
            )
    if not any(isinstance(m["content"], list) or m["content"].strip() for m in messages):
        raise ValueError(f"{where}: every message of {key!r} is empty; the model needs a prompt to answer")
    # an assistant turn's tool calls are kept (``tool_calls``: how the template gets them)
    return [{"role": m["role"], "content": m["content"], **_calls(m)} for m in messages]


def _check_parts(where: str, key: str, j: int, content: List[Any]) -> List[Dict[str, Any]]:
    """A message's content parts: ``{"type": "text", "text": str}`` or an image part (``IMAGE_PARTS``,
    normalised to ``{"type": "image"}``: the image itself is the record's, in order)."""
    out = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind in IMAGE_PARTS:
            out.append({"type": "image"})
        else:
            raise ValueError(
                f'{where}: part {k} of message {j} of {key!r} must be {{"type": "text", "text": ...}} or '
                f'{{"type": "image"}}, got {str(part)[:60]}'
            )
    return out


def _calls(m) -> Dict[str, Any]:
    return {"tool_calls": m["tool_calls"]} if m.get("tool_calls") else {}


def _record(
    where, lineno, row, index, input_key, label_key, metadata_key, label_optional=False, image_key=None, base_dir=None
) -> PromptRecord:
    kind = "row" if " row " in where else "JSON object"
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a {kind}, got {type(row).__name__}")
    required_label = None if label_optional else label_key
    keys = ((input_key, "--input-key"), (required_label, "--label-key"), (metadata_key, "--metadata-key"))
    for key, flag in keys + ((image_key, "--multimodal-keys"),):
        if key is not None and key not in row:
            raise ValueError(f"{where}: no key {key!r} ({flag}); keys are {sorted(row)}")
    prompt = row[input_key]
    if isinstance(prompt, list):
        prompt = check_messages(where, input_key, prompt, parts=image_key is not None)
    elif not isinstance(prompt, str):
        raise ValueError(
            f'{where}: {input_key!r} must be a string or a list of {{"role", "content"}} messages, got {type(prompt).__name__}'
        )
    elif not prompt.strip():
        raise ValueError(
            f"{where}: {input_key!r} is empty; the model needs a prompt to answer. Fix: remove the line or fill in its prompt"
        )
    metadata = None
    if metadata_key is not None:
        metadata = row[metadata_key]
        if isinstance(metadata, str):  # Parquet writers often store a JSON object as a string
            try:
                metadata = json.loads(metadata)
            except json.JSONDecodeError:
                pass
        if not isinstance(metadata, dict):
            raise ValueError(
                f"{where}: {metadata_key!r} (--metadata-key) must be an object, got {type(metadata).__name__}"
            )
    label = row.get(label_key) if label_key else None
    images = record_images(where, image_key, row[image_key], base_dir) if image_key is not None else None
    return PromptRecord(prompt, label, index, lineno, metadata, where, images)


def read_prompts(
    path,
    input_key: str,
    label_key: Optional[str],
    metadata_key: Optional[str] = None,
    label_optional: bool = False,
    image_key: Optional[str] = None,
) -> List[PromptRecord]:
    """All records of a JSONL or Parquet prompt file (see the module docstring for the rules);
    ``label_optional``: a record without the label key has label None (SFT chats, whose answers
    are their assistant turns); ``image_key``: the record key of its images (``--multimodal-keys``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--prompt-data {path}: no such file")
    rows = _parquet_rows(path) if is_parquet(path) else _jsonl_rows(path)
    records: List[PromptRecord] = []
    for where, lineno, row in rows:
        rec = _record(
            where, lineno, row, len(records), input_key, label_key, metadata_key, label_optional, image_key, path.parent
        )
        records.append(rec)
    if not records:
        raise ValueError(f"--prompt-data {path}: the file holds no prompts")
    return records


read_jsonl = read_prompts  # the name before Parquet was read too


class PromptDataset:
    def __init__(self, records: List[PromptRecord], *, shuffle: bool = False, seed: int = 0):
        self.records, self.shuffle, self.seed = records, shuffle, seed
        self.epoch, self.offset = 0, 0
        self._order = self._epoch_order(0)

    @classmethod
    def from_file(
        cls,
        path,
        input_key: str = "prompt",
        label_key: Optional[str] = "label",
        metadata_key: Optional[str] = None,
        image_key: Optional[str] = None,
        **kw,
    ) -> "PromptDataset":
        return cls(read_prompts(path, input_key, label_key, metadata_key, image_key=image_key), **kw)

    from_jsonl = from_file  # the name before Parquet was read too

    def __len__(self) -> int:
        return len(self.records)

    def _epoch_order(self, epoch: int) -> List[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> List[PromptRecord]:
        out = []
        while len(out) < n:
            if self.offset == len(self._order):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            take = min(n - len(out), len(self._order) - self.offset)
            out.extend(self.records[i] for i in self._order[self.offset : self.offset + take])
            self.offset += take
        return out

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self._epoch_order(self.epoch)
