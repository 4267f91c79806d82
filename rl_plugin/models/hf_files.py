"""What a Hugging Face model directory must hold before a run starts: ``config.json`` and weights.

A directory with only the config and tokenizer (an interrupted download, ``--include '*.json'``)
otherwise fails minutes later inside an actor with a transformers/mbridge traceback. Weights are
any of the formats ``from_pretrained`` reads: ``model.safetensors``, sharded
``model-0000x-of-0000y.safetensors`` (+ ``.index.json``), ``pytorch_model*.bin``.
"""

from __future__ import annotations

from pathlib import Path

from rl_plugin.arguments._util import RLArgumentError

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


class ModelFilesError(RLArgumentError):
    """A model directory that cannot be loaded; the message names the flag, the rule and the fix."""


def check_hf_weights(path, flag: str = "--hf-checkpoint") -> None:
    d = Path(path)
    if any(next(d.glob(p), None) is not None for p in WEIGHT_PATTERNS):
        return
    present = sorted(p.name for p in d.iterdir())[:8] if d.is_dir() else []
    raise ModelFilesError(
        f"{flag} {path}: no weight files there ({' or '.join(WEIGHT_PATTERNS)}); it holds {present}. "
        "Fix: download the complete model (e.g. `huggingface-cli download REPO --local-dir DIR` fetches the "
        "weights too) or point the flag at the directory that has them"
    )
