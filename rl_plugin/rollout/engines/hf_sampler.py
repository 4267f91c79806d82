"""Ancestral sampling for the ``hf`` engine: a lean loop that reproduces ``model.generate`` bit for bit.

For one bucket of equal-length prompts ``x`` ([B, L], no padding) both functions below return
``tokens`` [B, S] and ``log_probs`` [B, S] (fp32), S <= ``max_new_tokens``:

    z_t     = raw next-token logits of the model at step t (fp32), KV-cached forward
    s_t     = z_t / T                          (skipped when T == 1.0, as in HF)
    s'_t    = s_t with the tokens outside the top-p nucleus set to -inf   (only when top_p < 1)
    y_t     ~ Categorical(softmax(s'_t))       one ``torch.multinomial`` draw for EVERY row
    tok_t   = y_t for an unfinished row, ``pad_token_id`` for a row that already emitted an eos id
    logp_t  = log_softmax(s'_t)[tok_t]         (the log-prob under the distribution y_t was drawn
                                                from: with top_p < 1 the nucleus, renormalised, as
                                                vLLM's ``processed_logprobs``; with top_p = 1 it is
                                                log_softmax(z_t / T), what the trainer computes)

and stop after S steps, when every row has emitted one of the eos ids or S = ``max_new_tokens``.

``sample_with_generate`` is ``model.generate(do_sample=True, top_k=0, output_logits=True, ...)``
with the log-probs taken from its stacked raw logits (the engine's original path; the fallback).
``sample`` is the same computation without generate's per-call and per-token machinery (config
validation, processor and stopping-criteria objects, growing ``input_ids``, stacked logits): the
same forward inputs (``position_ids``, a ``DynamicCache`` built from the text config,
``logits_to_keep=1``, no attention mask since prompts carry no padding), the same fp32 ops in the
same order for temperature and top-p (transformers' ``TemperatureLogitsWarper`` /
``TopPLogitsWarper``: sort ascending, cumulative softmax, drop ``cum <= 1 - top_p``, keep the
largest), the same ``softmax`` + ``multinomial`` on every row (finished rows draw too, so the
global RNG advances exactly as in generate), the same stop rule. It keeps only [B] per step
(log_softmax of each step's [B, V] instead of the stacked [B, S, V]: a row's log_softmax does
not depend on the rows beside it; checked bitwise on CPU by the tests, not run on a GPU here).

By default ``sample`` also prefills each distinct prompt once (``share_prompt_prefill``, as vLLM
and SGLang share a prompt's prefill among its n samples): the U distinct rows of the bucket
(``torch.unique``) run through the model, then their KV cache rows and last-position logits are
copied to all B rows by the inverse index, and decoding runs on the B rows as before. Each value
is the same per-row computation on the same inputs, so the log-probs equal the full-batch
prefill's up to the rounding of a GEMM run with another row count (bitwise on this CPU; the tests
allow fp32 rounding), and so do the tokens unless such a last bit moves a draw across a boundary.
``share_prompt_prefill=False`` is the full-batch prefill, the path tested bitwise against generate.

``invariant=True`` (true on-policy mode, the model patched by ``rl_plugin.invariant.make_invariant``):
each step's ``logp_t = rl_plugin.invariant.log_softmax(z_t, T)`` (fixed vocab blocks, the op the
trainer recomputes with), ``y_t ~ Categorical(exp(logp_t))`` and the rollout log-prob is
``logp_t[tok_t]``: the tokens are drawn from exactly the distribution whose log-probs the trainer
recomputes bitwise (top-p must be 1; the engine refuses otherwise). Not generate's bits.

``model_blocker`` (checked once per loaded model) and ``values_blocker`` (per call) name what
``sample`` cannot reproduce; the engine then falls back to ``sample_with_generate``: a checkpoint
whose generation config asks for anything beyond the sampling knobs the engine overrides
(repetition penalty, min length, min_p, suppressed tokens, a static or quantized cache, ...), a
model that overrides generate's input preparation (multimodal, encoder-decoder, remote code, no
``logits_to_keep`` / ``position_ids``, no default dynamic cache), a mixture-of-experts model off
CPU (generate switches its experts kernel for decoding), and sampling values generate itself
rejects or treats specially (T not a positive float, top_p outside [0, 1], max_new_tokens < 1),
so that generate raises its own error for those. Every other combination (any T > 0, top_p in
[0, 1], one or several eos ids, early stop, any prompt length) runs the lean loop. Tested bitwise
against ``sample_with_generate`` in ``tests/fast/rollout/engines/test_hf_sampler.py``.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Optional, Sequence, Tuple

import torch

from rl_plugin import invariant as invariant_ops
from rl_plugin.rollout import abort

# Generation-config fields whose non-default values change nothing ``sample`` does: token ids
# (the engine passes eos/pad itself), the knobs the engine overrides (do_sample, temperature,
# top_p, top_k, lengths) and output switches. Any other non-default field -> generate.
_NEUTRAL_FIELDS = {
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "decoder_start_token_id",
    "do_sample",
    "temperature",
    "top_p",
    "top_k",
    "max_length",
    "max_new_tokens",
    "output_attentions",
    "output_hidden_states",
    "output_scores",
    "output_logits",
    "return_dict_in_generate",
    "transformers_version",
    "_from_model_config",
}
# ... and fields that are neutral only at these values
_NEUTRAL_VALUES = {
    "use_cache": (True,),
    "cache_implementation": ("dynamic",),
    "num_beams": (1,),
    "num_return_sequences": (1,),
    "min_length": (0,),
    "min_new_tokens": (0,),
    "repetition_penalty": (1.0,),
    "encoder_repetition_penalty": (1.0,),
    "no_repeat_ngram_size": (0,),
    "encoder_no_repeat_ngram_size": (0,),
    "typical_p": (1.0,),
    "epsilon_cutoff": (0.0,),
    "eta_cutoff": (0.0,),
    "guidance_scale": (1.0,),
    "renormalize_logits": (False,),
    "remove_invalid_values": (False,),
    "length_penalty": (1.0,),  # beam search only
    "early_stopping": (False,),  # beam search only
}
# generate's steps that ``sample`` reimplements: a model overriding any of them prepares its
# forward differently
_GENERATE_STEPS = (
    "prepare_inputs_for_generation",
    "_prepare_position_ids_for_generation",
    "_prepare_cache_for_generation",
    "_update_model_kwargs_for_generation",
    "_prefill",
    "_sample",
)


def lean_sampling_blocker(model, temperature, top_p, max_new_tokens) -> Optional[str]:
    """Why ``sample`` would not reproduce ``model.generate`` for this model and these values, or None."""
    return values_blocker(temperature, top_p, max_new_tokens) or model_blocker(model)


def values_blocker(temperature, top_p, max_new_tokens) -> Optional[str]:
    """Sampling values generate rejects or treats specially (it then raises its own error), or None."""
    if not (isinstance(temperature, float) and temperature > 0):
        return f"temperature {temperature!r} is not a positive float"
    if not (isinstance(top_p, (int, float)) and 0 <= top_p <= 1):
        return f"top_p {top_p!r} is outside [0, 1]"
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        return f"max_new_tokens {max_new_tokens!r} is not a positive int"
    return None


def model_blocker(model) -> Optional[str]:
    """What in the model or its generation config ``sample`` does not reproduce, or None (fixed
    once the model is loaded: the engine checks it once)."""
    from transformers.generation.utils import GenerationMixin

    if model.config.is_encoder_decoder or model.is_remote_code():
        return "an encoder-decoder or remote-code model"
    for step in _GENERATE_STEPS:
        if getattr(type(model), step) is not getattr(GenerationMixin, step):
            return f"{type(model).__name__} overrides generate's {step}"
    params = inspect.signature(model.forward).parameters
    if not {"position_ids", "logits_to_keep", "past_key_values"} <= set(params):
        return f"{type(model).__name__}.forward takes no position_ids / logits_to_keep / past_key_values"
    if not model._supports_default_dynamic_cache():
        return f"{type(model).__name__} does not use the default dynamic cache"
    if model.device.type != "cpu" and "grouped_mm" in model.get_experts_implementation().values():
        return "a mixture-of-experts model off CPU (generate switches its experts kernel for decoding)"
    for field, value in model.generation_config.to_diff_dict().items():
        if field in _NEUTRAL_FIELDS or value is None or value in _NEUTRAL_VALUES.get(field, ()):
            continue
        return f"the generation config sets {field}={value!r}"
    return None


def _top_p_mask(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """``scores`` with the tokens outside the top-p nucleus at -inf, computed exactly as
    transformers' ``TopPLogitsWarper`` (min_tokens_to_keep=1) does, op for op, in fp32."""
    ascending, order = torch.sort(scores, descending=False)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative <= (1 - top_p)  # the low tail whose mass is at most 1 - top_p
    drop_sorted[..., -1:] = 0  # the most likely token always stays
    drop = drop_sorted.scatter(1, order, drop_sorted)
    return scores.masked_fill(drop, -float("inf"))


def distinct_prompts(input_ids: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(unique [U, L], inverse [B]) with ``unique[inverse] == input_ids`` when some of the B rows
    repeat (U < B, in any order: a rollout's n samples of one prompt), else None (nothing to share)."""
    unique, inverse = torch.unique(input_ids, dim=0, return_inverse=True)
    return (unique, inverse) if unique.shape[0] < input_ids.shape[0] else None


def _forward(model, step_ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
    """The last position's raw logits [rows, V] in fp32 (a copy: the model's output is dropped)."""
    out = model(
        input_ids=step_ids,
        past_key_values=cache,
        position_ids=positions,
        logits_to_keep=1,
        use_cache=True,
        return_dict=True,
    )
    return out.logits[:, -1].to(copy=True, dtype=torch.float32, device=step_ids.device)


def _prefill(model, input_ids: torch.Tensor, cache, share: bool) -> torch.Tensor:
    """Run the prompts ``input_ids`` [B, L] through the model, filling ``cache`` for all B rows;
    return the last prompt position's raw logits [B, V]. With ``share``, each distinct prompt runs
    once and its cache rows and logits are copied to its repeats (``index_select`` by the inverse
    index, the cache through its own ``reorder_cache``), as vLLM / SGLang share a prompt's prefix
    among its n samples: a row's forward does not depend on the rows beside it, so every value
    is the same computation on the same inputs (bitwise equal on the CPU tested; another machine's
    GEMM, a GPU's in particular, may pick another kernel for another row count, changing last bits)."""
    # generate's prefill inputs: a contiguous copy of the prompt, positions 0..L-1 per row
    shared = distinct_prompts(input_ids) if share else None
    prompts = shared[0] if shared else input_ids.clone(memory_format=torch.contiguous_format)
    positions = torch.arange(prompts.shape[1], dtype=torch.long, device=prompts.device).repeat(prompts.shape[0], 1)
    raw = _forward(model, prompts, positions, cache)
    if shared:
        inverse = shared[1]
        cache.reorder_cache(inverse)  # every layer's keys / values: index_select(0, inverse)
        raw = raw.index_select(0, inverse)
    return raw


@torch.inference_mode()  # as no_grad, without autograd's version counters: the same kernels, less overhead
def sample(
    model,
    input_ids: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    share_prompt_prefill: bool = True,
    gate=None,
    versions: Optional[list] = None,
    invariant: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, S], log_probs [B, S]) for prompts ``input_ids`` [B, L], drawing from the global
    RNG exactly as ``model.generate`` would (see the module docstring; check ``model_blocker``
    and ``values_blocker`` first). ``share_prompt_prefill``: prefill each distinct prompt once
    (the default); False: every row, as generate does (the reference).

    ``gate`` (a ``pause.GenerationGate``, fully asynchronous training): offered at every token
    boundary; when the weight version changed there, the next tokens are drawn under the new
    weights (``gate.mode`` retract: prompt + tokens so far prefilled again, a fresh cache;
    in_place: the old cache kept). ``versions`` then receives the version of each step's token.
    ``invariant``: sample from the invariant log-softmax (module docstring; top_p must be 1)."""
    from transformers import DynamicCache

    batch, length = input_ids.shape
    device = input_ids.device
    top_p, temperature = float(top_p), float(temperature)
    eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=device)
    pad = torch.tensor(int(pad_token_id), dtype=torch.long, device=device)
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    version = gate.enter() if gate is not None else 0
    try:
        raw = _prefill(model, input_ids, cache, share_prompt_prefill)
        return _decode(
            model,
            raw,
            cache,
            input_ids,
            unfinished,
            eos,
            pad,
            temperature,
            top_p,
            max_new_tokens,
            gate,
            version,
            versions,
            invariant,
        )
    finally:
        if gate is not None:
            gate.leave()


def _decode(
    model,
    raw,
    cache,
    input_ids,
    unfinished,
    eos,
    pad,
    temperature,
    top_p,
    max_new_tokens,
    gate,
    version,
    versions,
    invariant,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``sample``'s decode loop from the prompt's last logits ``raw`` (see ``sample``)."""
    batch, length = input_ids.shape
    device = input_ids.device
    tokens, log_probs = [], []
    done_before = torch.zeros(batch, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        if versions is not None:
            versions.append(version)
        if invariant:  # the trainer's op: draw from exp(logp) and report logp itself
            logp = invariant_ops.log_softmax(raw, temperature)
            drawn = torch.multinomial(logp.exp(), num_samples=1).squeeze(1)
        else:
            scaled = raw / temperature if temperature != 1.0 else raw  # x / 1.0 == x exactly
            warped = _top_p_mask(scaled, top_p) if top_p < 1.0 else scaled
            drawn = torch.multinomial(torch.nn.functional.softmax(warped, dim=-1), num_samples=1).squeeze(1)
            logp = torch.log_softmax(warped, dim=-1)
        token = torch.where(unfinished, drawn, pad)  # finished rows drew too (same RNG use), keep pad
        tokens.append(token)
        log_probs.append(logp.gather(-1, token[:, None]).squeeze(-1))
        unfinished &= ~torch.isin(token, eos)
        if not bool(unfinished.any()) or step == max_new_tokens - 1:
            break
        abort.check()  # an exit signal's abort: end within one decode step
        if gate is not None:
            if gate.on_rows_done is not None and bool((~unfinished & ~done_before).any()):
                newly = (~unfinished & ~done_before).nonzero().squeeze(1).tolist()
                done_before |= ~unfinished
                gate.on_rows_done(newly, (torch.stack(tokens, 1), torch.stack(log_probs, 1), list(versions or [])))
            now = gate.boundary()
            if now != version and gate.mode == "retract":
                version = now  # the tokens so far prefilled again under the new weights, a fresh cache
                from transformers import DynamicCache

                cache = DynamicCache(config=model.config.get_text_config(decoder=True))
                so_far = torch.cat([input_ids, torch.stack(tokens, dim=1)], dim=1)
                raw = _prefill(model, so_far, cache, False)
                continue
            version = now  # in_place: the next forward runs the new weights on the old cache
        positions = torch.full((batch, 1), length + step, dtype=torch.long, device=device)
        raw = _forward(model, token[:, None], positions, cache)
    return torch.stack(tokens, dim=1), torch.stack(log_probs, dim=1)


@contextlib.contextmanager
def image_places(model, kinds: Optional[torch.Tensor]):
    """Within the block, the vision-language model's image places in the prefill are the 1s of
    ``kinds`` (``mm_token_type_ids`` ``[B, L]``), so an ``<|image_pad|>`` the model sampled in an
    earlier turn (text, ``rollout.vl_turns``) takes no image features. Nothing for a text model."""
    inner = next((m for m in model.modules() if hasattr(type(m), "get_placeholder_mask")), None)
    if kinds is None or inner is None:
        yield
        return
    own = inner.get_placeholder_mask

    def places(input_ids, inputs_embeds, image_features=None, video_features=None):
        if image_features is None or inputs_embeds.shape[:-1] != kinds.shape:
            return own(input_ids, inputs_embeds, image_features=image_features, video_features=video_features)
        mask = kinds.to(device=inputs_embeds.device, dtype=torch.bool)
        if int(mask.sum()) != image_features.shape[0]:
            raise ValueError(f"{int(mask.sum())} image tokens for {image_features.shape[0]} image features")
        full = mask.unsqueeze(-1).expand_as(inputs_embeds)
        return full, torch.zeros_like(full)

    inner.get_placeholder_mask = places  # an instance attribute: this call only (removed below)
    try:
        yield
    finally:
        del inner.get_placeholder_mask


@torch.no_grad()
def sample_with_generate(
    model,
    input_ids: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    **images,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The same (tokens, log_probs) through ``model.generate`` (the reference and the fallback).
    ``images``: a vision-language model's ``pixel_values`` / ``image_grid_thw`` of the rows'
    images (``hf_engine.image_inputs``): generate's own multimodal prefill (the vision tower,
    the image embeddings placed at the image tokens, M-RoPE positions with their decode offset).
    The image places are ``mm_token_type_ids``' (``image_places``), not every ``<|image_pad|>`` id."""
    with image_places(model, images.get("mm_token_type_ids")):
        res = model.generate(
            **images,
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=True,
            temperature=temperature,
            top_p=top_p,
            top_k=0,
            max_new_tokens=max_new_tokens,
            eos_token_id=list(eos_token_ids),
            pad_token_id=pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = res.sequences[:, input_ids.shape[1] :]
    logits = torch.stack(res.logits, dim=1).float()  # raw logits, [B, S, V]
    scaled = logits / temperature
    if top_p < 1.0:  # the sampler's distribution: the nucleus, renormalised (see ``sample``)
        scaled = _top_p_mask(scaled.reshape(-1, scaled.shape[-1]), top_p).view_as(scaled)
    log_probs = torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, log_probs
