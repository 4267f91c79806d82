"""``--check-weight-sync``: both sides of a sync hash what they hold and the driver compares.

``weights_fingerprint``: sha256 of every tensor's bytes (as fp32, contiguous); equal
fingerprints mean bitwise-equal weights. Train rank 0 fingerprints the export it just published,
every engine its weights right after loading; ``compare_fingerprints`` names the first tensor
that differs.
"""

from __future__ import annotations

import hashlib
from typing import Dict

import torch

from rl_plugin.errors import WeightSyncError


def tensor_fingerprint(tensor: torch.Tensor) -> str:
    """sha256 of one tensor's bytes (fp32, contiguous): a streamed export hashes as it goes."""
    t = tensor.detach().to("cpu", torch.float32).contiguous()
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def weights_fingerprint(state_dict: Dict[str, torch.Tensor]) -> Dict[str, str]:
    """sha256 of every tensor's bytes (fp32, contiguous): equal fingerprints = bitwise-equal weights."""
    return {name: tensor_fingerprint(state_dict[name]) for name in sorted(state_dict)}


def compare_fingerprints(trainer: Dict[str, str], rollout: Dict[str, str]) -> None:
    """Raise ``WeightSyncError`` naming the first tensor whose rollout copy differs."""
    for name in sorted(trainer):
        if name not in rollout:
            raise WeightSyncError(
                f"--check-weight-sync: the rollout engine has no tensor {name!r} that the trainer exports"
            )
        if rollout[name] != trainer[name]:
            raise WeightSyncError(
                f"--check-weight-sync: rollout weights differ from the trainer's at {name!r} "
                f"(sha256 {rollout[name][:12]} vs {trainer[name][:12]}): the weight sync is broken"
            )
