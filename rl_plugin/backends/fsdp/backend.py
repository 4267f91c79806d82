"""``FSDPBackend``: one training process of the FSDP2 backend (see ``rl_plugin.backends.base``).

The step is the core's (``rl_plugin.loss.runner.StepRunner``); this backend supplies::

    forward(model, mb, opts) -> [n, 2] (logp, entropy)   packing.micro_batch_log_probs: HF forward
                                                       (samples as a padded causal batch, or one
                                                       row under a block-diagonal causal mask),
                                                       fused head (or logits + log-softmax)
    schedule(model, M, forward, loss)                  for i < passes: loss(i, forward(i)).backward()
    optimizer_step()       -> (grad_norm, lr)          clip(--clip-grad); AdamW; Megatron LR schedule

Exactly dJ/dtheta: FSDP2 is told to SUM gradients over DP (``model.shard_model``), so each
micro-batch's objective is backpropagated with factor 1; its micro-batch shares already sum to J.

FSDP unshards each layer collectively, so every DP rank runs the same number of forward (and
backward) passes: the micro-batch count is MAX-reduced over DP and a rank with fewer micro-batches
(or no samples at all) runs one-token passes whose output is multiplied by 0.

Devices: the model and the loss live on ``self.device`` (CUDA when present). The DP group the
loss core reduces counts and metrics over carries CPU scalars: under NCCL it is a gloo twin of
the device mesh's group (``parallel.cpu_group``).

LoRA (``--lora-rank``, ``lora.py``): PEFT's adapters on the HF model before sharding, only they
train; the reference policy is the same model with its adapters disabled (PEFT's
``disable_adapter``); a weight sync streams the adapters only (``stream_lora_adapters``); the
checkpoint holds the adapters, their optimizer state and the base's identity; ``--save-hf``
writes a PEFT adapter directory (``--save-hf-merged``: also the merged HF model).

The value model (``config.value_head``, the critic; ``value_model.py``): the HF model as
``<Family>ForTokenClassification`` with one label, ``forward`` with ``options.values`` returns
``[n, 1]`` values; checkpoints as the policy's, ``--save-hf`` in the token-classification form.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
from dataclasses import replace
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from rl_plugin.backends.base import TrainBackend
from rl_plugin.backends.fsdp import checkpoint as ckpt
from rl_plugin.backends.fsdp import lora
from rl_plugin.backends.fsdp.model import (
    fused_head_unsupported,
    install_fp32_lm_head,
    install_fused_head,
    load_hf_model,
    shard_model,
)
from rl_plugin.backends.fsdp.optim import build_optimizer, clip_grad_norm, megatron_lr, set_lr
from rl_plugin.backends.fsdp.packing import micro_batch_log_probs, real_token_rows
from rl_plugin.backends.fsdp.router_losses import RouterLosses
from rl_plugin.backends.fsdp.true_on_policy import invariant_log_probs
from rl_plugin.backends.fsdp.value_model import idle_values, micro_batch_values
from rl_plugin.backends.fsdp.vision import freeze_tower, image_inputs, placeholders
from rl_plugin.checkpoint.lora_meta import lora_meta
from rl_plugin.configs import TrainConfig
from rl_plugin.invariant.hf_patch import make_invariant
from rl_plugin.lora.peft_dir import write_run_adapters
from rl_plugin.lora.scaling import lora_scaling
from rl_plugin.loss import ForwardOptions, StepRunner
from rl_plugin.models.moe_names import model_to_checkpoint, to_checkpoint
from rl_plugin.models.tiny import default_tiny_checkpoint
from rl_plugin.models.value_head import write_value_hf_dir
from rl_plugin.parallel import ParallelState, all_reduce, cpu_group

logger = logging.getLogger(__name__)

# HF config fields with which a model applies dropout functionally in its training forward.
DROPOUT_CONFIG_FIELDS = (
    "attention_dropout",
    "hidden_dropout",
    "dropout",
    "activation_dropout",
    "attn_pdrop",
    "resid_pdrop",
    "embd_pdrop",
)


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _tied_names(model) -> List[str]:
    """State-dict names that alias an earlier parameter (tied weights), e.g. ``lm_head.weight``."""
    seen, tied = set(), []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.append(name)
        seen.add(id(p))
    return tied


def gather_to_rank0(value: torch.Tensor) -> Optional[torch.Tensor]:
    """The full tensor of a DTensor on global rank 0 (None elsewhere); a plain tensor as it is.

    FSDP2's placement (one mesh dimension, ``Shard(0)``) cuts dim 0 as ``torch.chunk`` does:
    chunks of ``c = ceil(n / world)`` rows, the last ones shorter or empty. Each rank pads its
    shard to ``c`` rows and ``dist.gather`` writes them into row blocks of one buffer on rank 0,
    whose first ``n`` rows are the tensor (no concatenation copy; no full copy on other ranks).
    Any other placement: ``DTensor.full_tensor()`` (an all-gather: every rank holds it briefly)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return value
    exporter = dist.get_rank() == 0
    mesh, placements = value.device_mesh, value.placements
    if mesh.ndim != 1 or len(placements) != 1 or not placements[0].is_shard(0):
        full = value.full_tensor()
        return full if exporter else None
    group = mesh.get_group()
    world = dist.get_world_size(group)
    n, rest = value.shape[0], tuple(value.shape[1:])
    rows = -(-n // world)
    local = value.to_local()
    if local.shape[0] != rows:
        pad = local.new_zeros((rows - local.shape[0], *rest))
        local = torch.cat([local, pad]) if local.shape[0] else pad
    buf = torch.empty((world * rows, *rest), dtype=local.dtype, device=local.device) if exporter else None
    dist.gather(
        local.contiguous(), list(buf.split(rows)) if exporter else None, dst=dist.get_global_rank(group, 0), group=group
    )
    return buf[:n] if exporter else None


class FSDPBackend(TrainBackend):
    def __init__(self, config: TrainConfig):
        if not dist.is_initialized():
            raise RuntimeError("FSDPBackend needs torch.distributed initialised (gloo on CPU, nccl on GPU)")
        from torch.distributed.device_mesh import init_device_mesh

        if config.value_head and config.lora.enabled:
            # the critic trains all its weights; --lora-rank is the actor's (value_model.py)
            logger.info("value model: --lora-rank %d applies to the actor only", config.lora.lora_rank)
            config = replace(config, lora=replace(config.lora, lora_rank=0))
        self.config = config
        self.hf_dir = config.model.hf_checkpoint or default_tiny_checkpoint()
        self.device = _device()
        world, rank = dist.get_world_size(), dist.get_rank()
        self.mesh = init_device_mesh(self.device.type, (world,), mesh_dim_names=("dp",))
        group = cpu_group(self.mesh.get_group("dp")) if world > 1 else None  # counts, plan, metrics: CPU
        self.parallel_state = ParallelState(dp_size=world, dp_rank=rank, dp_group=group, dp_cp_group=group)
        self.loss_config = config.loss
        self.loss_device = self.device
        self.attn_implementation = config.model.attn_implementation
        random.seed(config.model.seed)
        np.random.seed(config.model.seed)
        torch.manual_seed(config.model.seed)
        self.peft_model = None  # LoRA: PEFT's wrapper of self.model (its disable_adapter() gives the base)
        self.model = self._build_model()
        self.model_type = self.model.config.model_type  # MoE export names (models.moe_names)
        self.router_losses = RouterLosses.for_model(self.model, config.model.moe)  # MoE --moe-*-loss-coeff
        self._real_micro_batches = 0
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.model, config.optimizer)
        self.optimizer_steps = 0
        self._ref_model = None
        self._teacher_model = None  # --use-opd --opd-type megatron, built on first use
        self.runner = StepRunner(
            self,
            micro_batch_size=config.batching.micro_batch_size,
            max_tokens_per_gpu=config.batching.max_tokens_per_gpu,
        )

    @classmethod
    def from_config(cls, config: TrainConfig) -> "FSDPBackend":
        return cls(config)

    # -- model ------------------------------------------------------------------------------
    def _build_model(self, *, frozen: bool = False, source: Optional[str] = None):
        """The policy (or, ``frozen``, a forward-only copy) from ``--hf-checkpoint``; ``source``: a
        forward-only model from another directory (the OPD teacher), which sets nothing here."""
        from transformers import AutoConfig

        if source is not None:
            model = load_hf_model(source, attn_implementation=self.attn_implementation)
            if self.config.true_on_policy:
                make_invariant(model)
            elif self._use_fused_head(model):
                install_fused_head(model, fp32=self.config.model.fp32_lm_head)
            model.requires_grad_(False).eval().to(self.device)
            return shard_model(model, self.mesh, bf16=self.config.model.bf16)
        dtype = AutoConfig.from_pretrained(self.hf_dir).dtype or torch.float32
        self.hf_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype  # --save-hf writes this dtype
        if self.config.value_head and not frozen:
            return self._build_value_model()
        model = load_hf_model(self.hf_dir, attn_implementation=self.attn_implementation)
        if self.config.true_on_policy:  # every op of the model on rl_plugin.invariant (true_on_policy.py)
            make_invariant(model)
        elif self._use_fused_head(model):
            install_fused_head(model, fp32=self.config.model.fp32_lm_head)
        elif self.config.model.fp32_lm_head:
            install_fp32_lm_head(model)
        self.tied_names = _tied_names(model)
        if self.lora_enabled and not frozen:  # adapters on the unsharded model, before fully_shard
            cfg = self.config.lora
            self.peft_model = lora.apply_lora(model, cfg, self.config.model.seed)
            if cfg.lora_adapter_path:
                lora.load_adapter_dir(model, cfg.lora_adapter_path)
        if self.config.freeze_vision_tower and not frozen:  # vision.py: no grads, no optimizer state
            logger.info("--freeze-vision-tower: %d vision tower weights frozen", freeze_tower(model))
        if frozen:
            model.requires_grad_(False).eval()
        model.to(self.device)
        return shard_model(model, self.mesh, bf16=self.config.model.bf16)

    def _build_value_model(self):
        """The critic (``value_model.py``): the scalar head as it is, no LM head to replace, no LoRA."""
        model = load_hf_model(self.hf_dir, attn_implementation=self.attn_implementation, value_head=True)
        self.tied_names = []
        return shard_model(model.to(self.device), self.mesh, bf16=self.config.model.bf16)

    def _use_fused_head(self, model) -> bool:
        """The fused head + log-probs unless ``--disable-fused-lm-head`` or the model needs its logits."""
        if not self.config.model.fused_lm_head:
            return False
        reason = fused_head_unsupported(model)
        if reason is not None:
            logger.warning("fused LM head not used: %s; log-probs come from the full logits", reason)
        return reason is None

    def _reference(self):
        """The frozen reference policy (``--use-kl-loss``): the ``--hf-checkpoint`` weights."""
        if self._ref_model is None:
            self._ref_model = self._build_model(frozen=True)
        return self._ref_model

    def _teacher(self):
        """The OPD teacher (``--opd-teacher-load``), frozen, built on first use."""
        if self._teacher_model is None:
            self._teacher_model = self._build_model(source=self.config.loss.opd_teacher_load)
        return self._teacher_model

    def model_for(self, role: str):
        if (role == "critic") != self.config.value_head:
            kind = "a value model (value_head)" if self.config.value_head else "a policy"
            raise ValueError(f"model_for({role!r}): this FSDPBackend is {kind}")
        if role == "critic":
            return self.model
        if role == "teacher":
            return self._teacher()
        if role == "actor" or self.lora_enabled:  # LoRA: the reference is self.model, adapters off
            return self.model
        return self._reference()

    def compute_log_probs(self, batch, *, role: str = "actor", micro_batches=None):
        """The base's; with LoRA the ``ref`` pass runs the actor with its adapters disabled
        (PEFT's ``disable_adapter``): the frozen base, with no second copy of it."""
        if role == "ref" and self.lora_enabled:
            with self.peft_model.disable_adapter():
                return super().compute_log_probs(batch, role=role, micro_batches=micro_batches)
        return super().compute_log_probs(batch, role=role, micro_batches=micro_batches)

    def deterministic_forward(self) -> bool:
        """No dropout in the training forward (the eval forward never has any): no active
        ``nn.Dropout`` module and no positive attention / hidden dropout in the model's config."""
        if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.model.modules()):
            return False
        cfg = self.model.config
        return not any(float(getattr(cfg, name, 0.0) or 0.0) > 0 for name in DROPOUT_CONFIG_FIELDS)

    # -- the runner's backend interface (rl_plugin.loss.StepBackend) -----------------------------
    def forward(self, model, inputs, options: ForwardOptions) -> torch.Tensor:
        if options.values:  # the critic: [n, 1] values (value_model.py)
            if inputs.layout.num_samples == 0:
                return idle_values(model, self.device)
            return micro_batch_values(model, inputs, self.attn_implementation, self.device)
        if inputs.layout.num_samples == 0:
            # An idle pass: one token through the model so this rank joins FSDP's collectives;
            # its output, times 0, carries the graph so the backward joins them too.
            ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
            blank = image_inputs(model, inputs) or {}  # a vision-language model runs its tower too (vision.py)
            with placeholders(model, None) if blank else contextlib.nullcontext() as seen:
                images = {k: v.to(self.device) for k, v in blank.items() if k in ("pixel_values", "image_grid_thw")}
                logits = model(input_ids=ids, use_cache=False, **images).logits
            out = seen.touch(logits.float()) if blank else logits.float()
            return (out.sum() * 0.0).expand(0, 2)
        router = self.router_losses if model is self.model and model.training and torch.is_grad_enabled() else None
        if router is not None:
            router.capture, router.rows = True, real_token_rows(inputs, self.attn_implementation, self.device)
        routing = self.routing_pass
        try:
            with routing.context(model, inputs) if routing is not None else contextlib.nullcontext():
                log_probs = invariant_log_probs if self.config.true_on_policy else micro_batch_log_probs
                logp, ent = log_probs(model, inputs, options, self.attn_implementation, self.device)
        finally:
            if router is not None:
                router.capture = False
        return torch.stack([logp, ent], 1)

    def new_routing_pass(self, action: str):
        from rl_plugin.backends.fsdp.routing_replay import RoutingPass

        return RoutingPass(action, self.attn_implementation)

    def schedule(self, model, num_micro_batches: int, forward, loss, *, forward_only: bool) -> int:
        """Every DP rank runs the largest micro-batch count over DP (FSDP is collective); the
        runner hands a rank past its own count empty micro-batches (idle passes)."""
        n = torch.tensor([num_micro_batches], dtype=torch.long)
        passes = int(all_reduce(n, self.parallel_state.dp_group, dist.ReduceOp.MAX).item())
        router = None if forward_only else self.router_losses
        if not forward_only:
            self._real_micro_batches = num_micro_batches
        for i in range(passes):
            objective = loss(i, forward(i))
            if router is not None and router.logits:  # MoE router losses: their mean over M x DP
                objective = objective + router.term() / (num_micro_batches * self.parallel_state.dp_size)
            if not forward_only:
                objective.backward()  # factor 1: FSDP sums over DP (module docstring)
        return passes

    def train_step(self, batch, *, num_groups: int, micro_batches=None, old_from_forward: bool = False):
        """The base step, plus the MoE router losses' metrics (``router_losses``)."""
        report = super().train_step(
            batch, num_groups=num_groups, micro_batches=micro_batches, old_from_forward=old_from_forward
        )
        if self.router_losses is not None:
            report.update(self.router_losses.metrics(self._real_micro_batches, self.parallel_state))
        return report

    def optimizer_step(self) -> Tuple[float, float]:
        norm = clip_grad_norm(self.params, self.config.optimizer.clip_grad)
        if not math.isfinite(norm):
            # Same rank-consistent outcome as Megatron's skipped step: nothing is applied.
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(
                f"non-finite gradient norm ({norm}) at optimizer step {self.optimizer_steps + 1}: "
                "the step was not applied (check old_log_probs / advantages of this batch)"
            )
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        set_lr(self.optimizer, megatron_lr(self.config.optimizer, self.optimizer_steps))
        return norm, lr

    # -- weights and checkpoints ------------------------------------------------------------
    def export_hf_state_dict(self) -> Dict[str, torch.Tensor]:
        """Full fp32 master weights under HF names on every rank (tied names included).

        Always copies: at DP=1 the all-gather of a one-shard DTensor returns the live parameter,
        and a caller holding the dict across a step must not see it change."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
        sd = {k: v.detach().to("cpu", copy=True) for k, v in sd.items()}
        if self.lora_enabled:  # the merged model: W_base + (alpha / r) B A, HF names
            sd = lora.merged_state_dict(sd, lora_scaling(self.config.lora.lora_alpha, self.config.lora.lora_rank))
        return model_to_checkpoint(sd, self.model_type)  # MoE: one tensor per expert (models.moe_names)

    def hf_weight_specs(self) -> Optional[Dict[str, torch.Tensor]]:
        """None with LoRA (a full export is the merged ``export_hf_state_dict``). The state dict's names (tied names included; MoE experts split as the checkpoint names
        them), global shapes and dtypes, as meta tensors."""
        if self.lora_enabled:
            return None
        return {
            n: torch.empty(t.shape, dtype=t.dtype, device="meta")
            for k, v in self.model.state_dict().items()
            for n, t in to_checkpoint(k, torch.empty(v.shape, dtype=v.dtype, device="meta"), self.model_type)
        }

    def stream_hf_weights(self, *, host: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        """One parameter at a time, every rank joining its gather (``gather_to_rank0``; a tied
        name is gathered again rather than kept); only rank 0 holds the result, copied to the CPU
        (``host=False``: left on the device). The other ranks hold nothing beyond their own shard."""
        exporter = dist.get_rank() == 0
        for name, value in self.model.state_dict().items():
            full = gather_to_rank0(value)
            if exporter:
                full = full.detach().to("cpu") if host else full.detach()
                for hf_name, t in to_checkpoint(name, full, self.model_type):
                    yield hf_name, t.contiguous()
            del full

    def lora_adapter_specs(self) -> Dict[str, torch.Tensor]:
        return lora.adapter_specs(self.model)

    def stream_lora_adapters(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """Every adapter, gathered one at a time to rank 0 (``gather_to_rank0``), canonical names, fp32."""
        return lora.stream_adapters(self.model, gather_to_rank0)

    def save_hf(self, out_dir: Optional[str]) -> None:
        """Write a Hugging Face directory (config + safetensors in the checkpoint's dtype); collective.
        With LoRA: a PEFT adapter directory at ``out_dir`` (if given) and, with ``--save-hf-merged
        DIR``, the merged model at DIR."""
        if self.lora_enabled:
            cfg = self.config.lora
            if out_dir:
                adapters = dict(self.stream_lora_adapters())  # collective; rank 0 holds them
                if dist.get_rank() == 0:
                    targets = self.peft_model.peft_config[lora.ADAPTER].target_modules  # a VL model's regex
                    write_run_adapters(out_dir, adapters, cfg, str(self.hf_dir), targets)
                dist.barrier()
            if not cfg.save_hf_merged:
                return
            out_dir = cfg.save_hf_merged
        state = self.export_hf_state_dict()
        if self.config.value_head:  # <Family>ForTokenClassification, one label (models.value_head)
            if dist.get_rank() == 0:
                write_value_hf_dir(out_dir, state, self.model.config, source_dir=self.hf_dir, dtype=self.hf_dtype)
            dist.barrier()
            return
        ckpt.write_hf_dir(
            out_dir, state, self.model.config, source_dir=self.hf_dir, tied_keys=self.tied_names, dtype=self.hf_dtype
        )

    def save_checkpoint(self, path: str, *, step: int, extra: Optional[Dict[str, Any]] = None) -> List[str]:
        extra = dict(extra or {})
        written = ckpt.save(
            path,
            self.model,
            self.optimizer,
            step=step,
            extra=extra,
            backend_state={"optimizer_steps": self.optimizer_steps},
            lora_meta=lora_meta(self.config.lora, self.hf_dir),
        )
        if self.config.model.save_hf or (self.lora_enabled and self.config.lora.save_hf_merged):
            self.save_hf(self.config.model.save_hf)
        return written

    def load_checkpoint(self, path: str) -> Dict[str, Any]:
        current = lora_meta(self.config.lora, self.hf_dir)
        meta = ckpt.load(path, self.model, self.optimizer, hf_dir=self.hf_dir, lora_meta=current)
        self.optimizer_steps = int(meta.get("backend", {}).get("optimizer_steps", meta["step"]))
        set_lr(self.optimizer, megatron_lr(self.config.optimizer, self.optimizer_steps))
        return {"step": int(meta["step"]), "extra": meta.get("extra", {})}
