"""Helpers for the Megatron value model's tests (issue 47; no test logic here).

- ``value_backend(hf_dir, *flags, world_size=1)``: a ``MegatronBackend`` built as the critic's
  (the run's ``TrainConfig`` with ``value_head=True``) from real command-line flags.
- ``seeded_head(backend, seed)``: the head set to seeded values (the same on every rank; a fresh
  head is zeros, under which values carry no information), the optimizer's main params too.
- ``hf_values(model_dir, batch)``: the values of an HF ``AutoModelForTokenClassification`` directory,
  one sample at a time (no packing): the position before each response token, as a log-prob.
"""

from __future__ import annotations

from dataclasses import replace

import torch


def value_backend(hf_dir: str, *flags: str, world_size: int = 1):
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from rl_plugin.configs.run import RunConfig
    from tests.support.megatron_common import make_args

    args = make_args("--hf-checkpoint", hf_dir, *flags, world_size=world_size)
    return MegatronBackend.from_config(replace(RunConfig.from_args(args).train, value_head=True))


def seeded_head(backend, seed: int = 0, scale: float = 1.0) -> None:
    from rl_plugin.backends.megatron.chunks import chunks_of
    from rl_plugin.backends.megatron.forward import unwrap

    if backend.parallel_state.is_last_stage:
        head = unwrap(chunks_of(backend.model)[-1]).output_layer.weight
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            head.copy_(scale * torch.randn(head.shape, generator=g))
    backend.optimizer.reload_model_params()


def hf_values(model_dir: str, batch) -> torch.Tensor:
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(model_dir, dtype=torch.float32)
    out, off = [], 0
    with torch.no_grad():
        for t, r in zip(batch.total_lengths.tolist(), batch.response_lengths.tolist()):
            ids = batch.tokens[off : off + t]
            out.append(model(ids[None]).logits[0, t - r - 1 : t - 1, 0])
            off += t
    return torch.cat(out)
