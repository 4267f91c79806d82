"""The value model on megatron-core (issue 47): the actor's GPTModel with a scalar head.

``attach_value_heads(chunks)`` replaces the output layer of the chunk holding the head (the last
pipeline stage; the last virtual stage under the interleaved schedule) by ``ValueHead``: one
weight ``[1, H]``, ZEROS unless loaded (``load_score``), the HF name ``score.weight`` of
``<Family>ForTokenClassification`` with ``num_labels=1``. Every chunk stops sharing the embedding
with the output (``share_embeddings_and_output_weights = False``): a tied model's embedding is
then an input embedding only, so neither ``finalize_model_grads`` (the embedding group's
all-reduce) nor the checkpoint (``tie_embeddings_and_output_weights_state_dict``) ties it to the
head. mbridge's name map sends ``output_layer.weight`` to ``score.weight`` (``value_bridge``), so
every export path (one stage, pipelined, the weight sync's stream, the meta specs) names the head
as HF does; the backbone keeps its ``model.*`` names.

The head is REPLICATED over TP: ``V = h_t . w`` (fp32) on the final (normed) hidden state h_t,
which is whole and identical on every TP rank (the last row-parallel linear all-reduces, the norm
is replicated). The value loss is then identical on every TP rank, and so is d(rows): unlike the
vocab-sharded LM head (whose d(rows) are partial sums, all-reduced in ``forward.response_rows``),
nothing is reduced over TP. The decoder's row-parallel backward is the identity, so each rank's
shard gets its full gradient; the head's and the norm's gradients are the same on every TP rank,
and megatron counts a replicated parameter once in the grad norm (``tensor_model_parallel``
False: ``param_is_not_tensor_parallel_duplicate``). Under ``--sequence-parallel`` the rows are
gathered from the sequence shards with a backward that SPLITS (not reduce-scatters) the full
gradient back. Pipeline parallelism: the head exists on the last stage only, where the loss runs.

Checkpoints: the head is a parameter of the GPTModel (``output_layer.weight``, a replicated
``ShardedTensor`` of global shape ``[1, H]``), so ``checkpoint.save`` / ``load`` carry it and
relayout it as every other tensor (and refuse an actor checkpoint: another shape).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import List, Optional

import torch

from rl_plugin.backends.megatron.forward import (
    half_precision_wrapped,
    hidden_states_only,
    model_inputs,
    moe_padding_kwargs,
    padded_logit_index,
    sequence_parallel_size,
    unwrap,
)
from rl_plugin.loss import MicroBatchInputs
from rl_plugin.models.value_head import HEAD

SCORE = HEAD  # "score.weight": HF <Family>ForTokenClassification's head


class ValueHead(torch.nn.Module):
    """``[n, H] -> [n, 1]`` fp32: ``rows @ weight^T`` with the weight ``[1, H]`` (module docstring)."""

    def __init__(self, hidden_size: int, *, device=None):
        from megatron.core.tensor_parallel import set_defaults_if_not_set_tensor_model_parallel_attributes

        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, device=device))
        set_defaults_if_not_set_tensor_model_parallel_attributes(self.weight)  # replicated over TP

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.float() @ self.weight.float().t()


def attach_value_heads(chunks: List[torch.nn.Module]) -> None:
    """Bare GPTModel chunks (before any wrapper) become the value model (module docstring)."""
    for gpt in chunks:
        gpt.share_embeddings_and_output_weights = False
        if gpt.post_process:
            weight = next(gpt.parameters())
            gpt.output_layer = ValueHead(gpt.config.hidden_size, device=weight.device)


@contextlib.contextmanager
def heads_detached(chunks: List[torch.nn.Module]):
    """The heads out of the modules (mbridge's ``load_weights`` then loads the backbone alone,
    from an actor's checkpoint with ``lm_head`` or a token-classification one with ``score``)."""
    saved = [(gpt, gpt.output_layer) for gpt in chunks if gpt.post_process]
    for gpt, _ in saved:
        gpt.output_layer = None
    try:
        yield
    finally:
        for gpt, head in saved:
            gpt.output_layer = head


def read_score(hf_dir: str) -> Optional[torch.Tensor]:
    """``score.weight`` of a Hugging Face directory's safetensors, or None (a causal LM's)."""
    from safetensors import safe_open

    for file in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if SCORE in f.keys():
                return f.get_tensor(SCORE)
    return None


def load_score(chunks: List[torch.nn.Module], hf_dir: str) -> bool:
    """The head of ``hf_dir`` (every rank reads it: replicated) into the head chunk; False (the
    head stays zeros) when ``hf_dir`` has none. A head of another shape is refused by name."""
    score = read_score(hf_dir)
    if score is None:
        return False
    for gpt in chunks:
        if gpt.post_process:
            head = gpt.output_layer.weight
            if tuple(score.shape) != tuple(head.shape):
                raise ValueError(
                    f"{hf_dir}: {SCORE} has shape {tuple(score.shape)}, the value model's head is "
                    f"{tuple(head.shape)} (one label on the hidden size). Fix: a critic checkpoint of this "
                    "model with num_labels=1, or the actor's checkpoint (a fresh, zero head)"
                )
            with torch.no_grad():
                head.copy_(score.to(head.dtype))
    return True


def value_bridge(bridge):
    """The bridge with ``output_layer.weight`` named ``score.weight`` (its instance map:
    ``compat.mbridge_fixes.tied_embeddings_bridge_class`` gives each bridge its own copy)."""
    bridge._DIRECT_MAPPING = {**bridge._DIRECT_MAPPING, "output_layer.weight": SCORE}
    return bridge


def response_values(model, mb: MicroBatchInputs, qkv_format: str) -> torch.Tensor:
    """``[n_local, 1]`` fp32 values of the micro-batch's CP-local response tokens: the head on the
    final hidden state at each ``logit_index`` row (the position whose logits predict the token)."""
    from megatron.core import tensor_parallel

    gpt = unwrap(model)
    device = next(model.parameters()).device
    input_ids, position_ids, psp = model_inputs(mb, qkv_format, sp_size=sequence_parallel_size(gpt), device=device)
    kwargs = {"fp32_output": False} if half_precision_wrapped(model) else {}
    kwargs.update({k: v.to(device) for k, v in moe_padding_kwargs(gpt, mb, input_ids).items()})
    with hidden_states_only(gpt):
        hidden = model(input_ids, position_ids, None, packed_seq_params=psp, **kwargs)  # [s(/tp), b, h]
    if gpt.config.sequence_parallel:  # identical full gradient on every TP rank: split it back, no sum
        hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
    rows = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])[padded_logit_index(mb, input_ids).to(device)]
    return gpt.output_layer(rows)
