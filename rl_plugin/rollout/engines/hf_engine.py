"""Hugging Face models as the rollout engine (the default; runs on CPU).

Sampling is ``rl_plugin.rollout.engines.hf_sampler.sample``, a lean loop equal bit for bit to
``model.generate`` (which it falls back to where it cannot be, see that module) that prefills a
rollout's n copies of a prompt once. Prompts are generated in buckets of equal prompt length (and
with or without images: a later turn of a hook or an agent may be text only), so no padding enters the forward pass and the sampler's log-probs are computed on exactly the inputs
the trainer later sees. The per-token log-prob is ``log_softmax(logits / T)`` of the raw logits
at the sampled token, the quantity the trainer recomputes at ``--rollout-temperature`` (top-p
truncation is a sampling choice and is not folded into it, as in slime/SGLang's returned
log-probs).

True on-policy mode (``EngineConfig.true_on_policy``): the model is patched by
``rl_plugin.invariant.make_invariant`` at load, prefill and decode run the invariant attention on
the KV cache, and each token is drawn from ``exp(invariant.log_softmax(logits / T))``, its
rollout log-prob that value: the trainer's recomputation (same ops) is bitwise equal. Top-p < 1
and models the lean sampler cannot run are refused.

LoRA (``--lora-rank``): syncs carry adapters only; this engine keeps the base of every targeted
linear and rewrites it as W_base + (alpha / r) B A after each bucket (``lora_merge``), never from
its previous merged weight. ``weights()`` then includes the adapters it holds (what
``--check-weight-sync`` / ``--check-lora-weight-equal`` compare with the trainer's).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from functools import partial
from typing import Dict, List, Optional, Sequence

import torch

from rl_plugin.configs import EngineConfig
from rl_plugin.invariant.hf_patch import make_invariant
from rl_plugin.lora.scaling import lora_scaling
from rl_plugin.models.moe_names import checkpoint_slot, model_to_checkpoint
from rl_plugin.rollout.engines.base import Generation, RolloutEngine, SamplingParams, eos_token_ids
from rl_plugin.rollout.engines.hf_sampler import (
    distinct_prompts,
    model_blocker,
    sample,
    sample_with_generate,
    values_blocker,
)
from rl_plugin.rollout.engines.lora_merge import KeptBaseMerge, split_bucket
from rl_plugin.routing.hf import RoutingRecorder, routing_shape


class HFEngine(RolloutEngine):
    def __init__(
        self,
        checkpoint_dir: str,
        *,
        device: str = "cpu",
        record_routed_experts: bool = False,
        lora_scaling: Optional[float] = None,
        true_on_policy: bool = False,
    ):
        from rl_plugin.models.vl_processor import auto_model_class

        self.device = torch.device(device)
        self.model = (
            auto_model_class(checkpoint_dir).from_pretrained(str(checkpoint_dir), dtype=torch.float32).to(self.device)
        )
        self.model.eval()
        cfg = self.model.config.get_text_config()  # a VL model: its language model's
        self.eos_token_ids = eos_token_ids(checkpoint_dir)
        self.pad_token_id = cfg.pad_token_id if cfg.pad_token_id is not None else self.eos_token_ids[0]
        # why the lean sampler cannot stand in for model.generate with this model (None: it does)
        self.lean_blocker: Optional[str] = model_blocker(self.model)
        # the lean sampler prefills each distinct prompt of a bucket once (False: every row)
        self.share_prompt_prefill = True
        # --use-rollout-routing-replay: each Generation carries the experts its tokens were routed to
        self.record_routed_experts = record_routed_experts
        # --lora-rank: the adapters received and the base they are merged into (None: no LoRA)
        self.lora = KeptBaseMerge(lora_scaling) if lora_scaling is not None else None
        if record_routed_experts:
            routing_shape(self.model)  # a dense model (or an unknown router) fails here, at start-up
        # true on-policy mode: the model on the invariant ops, sampling from their log-softmax
        self.true_on_policy = true_on_policy
        if true_on_policy:
            if self.lean_blocker:
                raise ValueError(
                    f"true on-policy mode needs the hf engine's lean sampler, which cannot run this model: {self.lean_blocker}"
                )
            make_invariant(self.model)

    @classmethod
    def create(cls, config: EngineConfig, checkpoint_dir: str, *, device: str) -> "HFEngine":
        """One device, no tensor parallelism (the flag layer refuses tp > 1); seeded per ``generate``."""
        scaling = lora_scaling(config.lora_alpha, config.lora_rank) if config.lora_rank > 0 else None
        return cls(
            checkpoint_dir,
            device=device,
            record_routed_experts=config.record_routed_experts,
            lora_scaling=scaling,
            true_on_policy=config.true_on_policy,
        )

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[List[int]], params: SamplingParams, *, seed: int, first_sample: int = 0, gate=None
    ) -> List[Generation]:
        # Seeded per call, not per sample: a rollout split over several hf engines samples
        # differently from one engine (``first_sample`` is unused). ``gate``: a pausable call
        # (``engines.pause``; fully asynchronous training), each token's version recorded.
        # (prompt length, with images) -> indices: no bucket needs padding or mixes text and image
        # prompts (a hook's or an agent's text-only turn in a run with images)
        buckets = defaultdict(list)
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
            buckets[(len(p), getattr(p, "pixel_values", None) is not None)].append(i)
        if params.top_k > 0:
            raise ValueError(
                f"top_k={params.top_k}: the hf engine samples without top-k; pass top_k -1 (or use --rollout-engine vllm)"
            )
        stop_ids = self.eos_token_ids + [t for t in params.stop_token_ids if t not in self.eos_token_ids]
        eos = torch.tensor(stop_ids, device=self.device)
        blocker = self.lean_blocker or values_blocker(params.temperature, params.top_p, params.max_new_tokens)
        if any(getattr(p, "pixel_values", None) is not None for p in prompts):
            blocker = "images"  # generate's multimodal prefill (hf_sampler)
        if self.true_on_policy:
            check_true_on_policy_sampling(params, blocker)
        sampler = (
            sample_with_generate
            if blocker
            else partial(sample, share_prompt_prefill=self.share_prompt_prefill, invariant=self.true_on_policy)
        )
        out: List[Generation] = [None] * len(prompts)  # type: ignore[list-item]
        gen = torch.Generator().manual_seed(int(seed))
        for key in sorted(buckets):
            idx = buckets[key]
            bucket = [prompts[i] for i in idx]
            # the sampler draws from the global RNG
            torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
            input_ids = torch.tensor(bucket, dtype=torch.long, device=self.device)
            versions: List[int] = []
            pausable = {} if gate is None else self._pausable(gate, blocker, bucket, idx, eos, versions)
            try:
                with (
                    RoutingRecorder(self.model) if self.record_routed_experts else contextlib.nullcontext() as recorder
                ):
                    tokens, log_probs = sampler(
                        self.model,
                        input_ids,
                        temperature=params.temperature,
                        top_p=params.top_p,
                        max_new_tokens=params.max_new_tokens,
                        eos_token_ids=stop_ids,
                        pad_token_id=self.pad_token_id,
                        **pausable,
                        **image_inputs(bucket, self.device),
                    )
            finally:
                if gate is not None and blocker:
                    gate.leave()
            generations = bucket_generations(bucket, tokens, log_probs, eos, versions if gate is not None else None)
            if recorder is not None:
                # the lean sampler's shared prefill ran the distinct prompts only (hf_sampler._prefill)
                shared = distinct_prompts(input_ids) if not blocker and self.share_prompt_prefill else None
                attach_routed_experts(generations, recorder.per_row(len(bucket), shared[1] if shared else None))
            for i, generation in zip(idx, generations):
                out[i] = generation
        return out

    @staticmethod
    def _pausable(gate, blocker, bucket, idx, eos, versions) -> Dict:
        """The sampler's extra arguments for a pausable bucket (``engines.pause``); the fallback
        (``model.generate``) cannot pause: the gate is held for the whole call and every token gets
        the version of its start."""
        if blocker:
            versions.append(gate.enter())  # left after the call (``generate``)
            return {}
        done = gate.on_generations_done

        def rows_done(rows: List[int], so_far) -> None:
            tokens, log_probs, step_versions = so_far
            gens = bucket_generations([bucket[r] for r in rows], tokens[rows], log_probs[rows], eos, step_versions)
            done([idx[r] for r in rows], gens)

        gate.on_rows_done = rows_done if done is not None else None
        return {"gate": gate, "versions": versions}

    @torch.no_grad()
    def update_weights(self, state_dict: Dict[str, torch.Tensor]) -> None:
        """A bucket (any subset of the tensors, checkpoint names): copied in place, an MoE expert
        into its slice of the model's fused expert parameter (``models.moe_names``); unknown
        names are rejected. LoRA adapters: kept, and merged into their linear from its kept base."""
        adapters, state_dict = split_bucket(state_dict)
        if adapters:
            if self.lora is None:
                raise ValueError(
                    f"weight sync: LoRA adapters ({next(iter(adapters))}) reached an engine built without --lora-rank"
                )
            touched = self.lora.receive(adapters)
            self.lora.apply(touched, lambda module: self.model.get_parameter(f"{module}.weight"))
        own = self.model.state_dict()
        model_type = self.model.config.model_type
        slots = {name: checkpoint_slot(name, model_type, own) for name in state_dict}
        unexpected = sorted(name for name, (_, view) in slots.items() if view is None)
        if unexpected:
            raise ValueError(
                f"weight sync: the trainer's export does not match the rollout model: unexpected {unexpected[:5]}"
            )
        for name, value in state_dict.items():
            target = slots[name][1]
            if target.shape != value.shape:
                raise ValueError(
                    f"weight sync: {name} has shape {tuple(value.shape)} from the trainer, {tuple(target.shape)} in the rollout model"
                )
            target.copy_(value.to(target.dtype))

    def sleep(self) -> None:
        """On a GPU: the model to host memory and the cached blocks back to the driver (no KV cache
        outlives a ``generate`` here). On a CPU the model is in host memory already: nothing."""
        if self.device.type == "cuda":
            self.model.to("cpu")  # the same Parameter objects: ``update_weights`` keeps working
            torch.cuda.empty_cache()

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        if self.device.type == "cuda":
            self.model.to(self.device)

    def weights(self) -> Dict[str, torch.Tensor]:
        """The weights under checkpoint names (MoE experts one tensor each)."""
        state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        state = model_to_checkpoint(state, self.model.config.model_type)
        if self.lora is not None:  # the adapters it holds and merges from
            state.update(self.lora.adapters)
        return state


def check_true_on_policy_sampling(params: SamplingParams, blocker: Optional[str]) -> None:
    """The mode samples from the invariant log-softmax of the whole vocabulary (what the trainer
    recomputes): no nucleus, and the lean sampler must run (generate's kernels are not ours)."""
    if params.top_p < 1.0:
        raise ValueError(
            f"true on-policy mode samples from the full distribution the trainer recomputes: top_p={params.top_p} "
            "would sample from a renormalised nucleus; use --rollout-top-p 1.0"
        )
    if blocker:
        raise ValueError(f"true on-policy mode needs the hf engine's lean sampler: {blocker}")


def image_inputs(bucket: Sequence[List[int]], device) -> Dict[str, torch.Tensor]:
    """A bucket's images for generate: every row's ``pixel_values`` and ``image_grid_thw``
    (``rollout.data.vl_prompt.ImagePrompt``) concatenated in row order, as the model's
    ``get_image_features`` splits them back, and each row's ``mm_token_type_ids`` (1 at its image
    tokens: generate's prefill then takes M-RoPE positions, its decode their offset); ``{}`` for
    text prompts."""
    rows = [p for p in bucket if getattr(p, "pixel_values", None) is not None]
    if not rows:
        return {}
    if len(rows) != len(bucket):
        raise ValueError("a bucket mixes prompts with and without images: give every record of the data its images")
    return {
        "pixel_values": torch.cat([p.pixel_values for p in rows]).to(device),
        "image_grid_thw": torch.cat([p.image_grid_thw for p in rows]).to(device),
        # which prompt tokens are image tokens: what the model's 3-D rope index (M-RoPE) reads
        "mm_token_type_ids": torch.tensor([p.mm_token_type_ids for p in rows], device=device),
    }


def bucket_generations(
    prompts: Sequence[List[int]],
    tokens: torch.Tensor,
    log_probs: torch.Tensor,
    eos: torch.Tensor,
    versions: Optional[List[int]] = None,
) -> List[Generation]:
    """One ``Generation`` per row of a bucket's sampled ``tokens`` / ``log_probs`` [B, S]: the
    response runs through its first eos id (``finished``), else all S steps. One tensor -> list
    conversion per bucket, then plain list slicing per sample; the prompt is copied (a rollout
    repeats one prompt list for its n samples). ``versions``: each step's weight version (a
    pausable call; one entry stands for every step), cut to each response."""
    is_eos = torch.isin(tokens, eos)
    finished = is_eos.any(1)
    lengths = torch.where(finished, is_eos.int().argmax(1) + 1, tokens.shape[1])
    rows = zip(prompts, tokens.tolist(), log_probs.tolist(), lengths.tolist(), finished.tolist())
    if versions is None:
        return [Generation(list(p), ids[:n], lps[:n], done) for p, ids, lps, n, done in rows]
    steps = versions if len(versions) >= tokens.shape[1] else versions[:1] * tokens.shape[1]
    return [Generation(list(p), ids[:n], lps[:n], done, None, steps[:n]) for p, ids, lps, n, done in rows]


def attach_routed_experts(generations: List[Generation], per_row: torch.Tensor) -> None:
    """Give each generation of a bucket its routed experts: row ``b`` of ``per_row``
    (``[B, S, num_layers, k]``, ``RoutingRecorder.per_row``) cut to the ``T - 1`` positions its
    own tokens ran through the model (prompt, then every response token but the last)."""
    for b, g in enumerate(generations):
        n = len(g.prompt_ids) + len(g.response_ids) - 1
        if per_row.shape[1] < n:
            raise RuntimeError(f"routing record: {per_row.shape[1]} positions recorded for a sample of {n + 1} tokens")
        g.routed_experts = per_row[b, :n].clone()
