"""``MegatronBackend``: the ``TrainBackend`` on megatron-core (one instance per training process).

    backend = MegatronBackend.from_config(cfg)  # a TrainConfig; torch.distributed already initialised
    old = backend.compute_log_probs(batch)       # forward only, actor (or role="ref")
    report = backend.train_step(batch, num_groups=P)
    hf = backend.export_hf_state_dict()          # TP-gathered, HF names, every rank
    backend.save_checkpoint(dir, step=k); backend.load_checkpoint(dir)

See ``setup.py`` (start-up), ``step.py`` (the step and why it applies exactly dJ/dtheta),
``forward.py`` (inputs and logits, ``--fp32-lm-head``), ``bridge.py`` (mbridge),
``checkpoint.py`` and ``cpu_shim.py`` (CPU / gloo).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from rl_plugin.backends.base import TrainBackend
from rl_plugin.backends.megatron import checkpoint, setup, step
from rl_plugin.backends.megatron.bridge import export_hf
from rl_plugin.backends.megatron.cpu_shim import apply_cpu_shim
from rl_plugin.backends.megatron.forward import fused_head_unsupported
from rl_plugin.batching import plan_micro_batches
from rl_plugin.configs import ModelConfig, TrainConfig
from rl_plugin.loss import StepBatch
from rl_plugin.models.tiny import default_tiny_checkpoint
from rl_plugin.parallel import ParallelState


logger = logging.getLogger(__name__)


def use_fused_head(model_config: ModelConfig, model) -> bool:
    """The fused head + log-probs (``forward.response_log_probs``) unless ``--disable-fused-lm-head``
    or the model's output layer needs the unfused path (then say why, once)."""
    if not model_config.fused_lm_head:
        return False
    reason = fused_head_unsupported(model)
    if reason is not None:
        logger.warning("fused LM head not used: %s; log-probs come from the full logits", reason)
    return reason is None


class MegatronBackend(TrainBackend):
    def __init__(self, config: TrainConfig, model, bridge, optimizer, scheduler, ps: ParallelState, hf_dir: str):
        self.config, self.model, self.bridge = config, model, bridge
        self.optimizer, self.scheduler = optimizer, scheduler
        self.parallel_state = ps
        self.hf_dir = hf_dir
        self.loss_config = config.loss
        self.fp32_lm_head = config.model.fp32_lm_head
        self.fused_lm_head = use_fused_head(config.model, model)
        self._ref_model = None
        config = bridge.config
        # What Megatron-LM's training loop sets: the schedule calls these.
        from megatron.core.distributed import finalize_model_grads

        config.no_sync_func = model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = optimizer.scale_loss

    @classmethod
    def from_config(cls, config: TrainConfig) -> "MegatronBackend":
        if not dist.is_initialized():
            raise RuntimeError("MegatronBackend.from_config: initialise torch.distributed first (gloo on CPU, nccl on GPU)")
        apply_cpu_shim()  # no-op where CUDA is present
        m, opt = config.model, config.optimizer
        setup.check_supported(m)
        ps = setup.init_parallel(m)
        hf_dir = m.hf_checkpoint or default_tiny_checkpoint()
        model, bridge = setup.build_model(m, hf_dir, use_distributed_optimizer=opt.use_distributed_optimizer)
        optimizer, scheduler = setup.build_optimizer(opt, model, bf16=m.bf16)
        return cls(config, model, bridge, optimizer, scheduler, ps, hf_dir)

    # -- micro-batches ------------------------------------------------------------------------
    def plan(self, batch: StepBatch) -> List[torch.Tensor]:
        b = self.config.batching
        return plan_micro_batches(batch, micro_batch_size=b.micro_batch_size, max_tokens_per_gpu=b.max_tokens_per_gpu,
                                  dp_group=self.parallel_state.dp_group)

    # -- TrainBackend ---------------------------------------------------------------------------
    def compute_log_probs(self, batch: StepBatch, *, role: str = "actor", micro_batches=None) -> torch.Tensor:
        if role == "actor":
            model = self.model
        elif role == "ref":
            model = self._reference_model()
        else:
            raise ValueError(f"role must be 'actor' or 'ref', got {role!r}")
        cfg = self.loss_config
        return step.forward_log_probs(
            model, batch, self.parallel_state, qkv_format=cfg.qkv_format, max_seq_len=cfg.max_seq_len,
            temperature=cfg.temperature, chunk_size=cfg.logprob_chunk_size,
            micro_batches=micro_batches if micro_batches is not None else self.plan(batch),
            fp32_lm_head=self.fp32_lm_head, fused_lm_head=self.fused_lm_head,
        )

    def train_step(self, batch: StepBatch, *, num_groups: int, micro_batches=None) -> Dict[str, Any]:
        return step.train_step(
            self.model, self.optimizer, self.scheduler, batch, self.loss_config, self.parallel_state,
            num_groups=num_groups, micro_batches=micro_batches if micro_batches is not None else self.plan(batch),
            fp32_lm_head=self.fp32_lm_head, fused_lm_head=self.fused_lm_head,
        )

    def export_hf_state_dict(self) -> Dict[str, torch.Tensor]:
        return {name: t.detach().to("cpu").clone() for name, t in export_hf(self.bridge, self.model)}

    def save_checkpoint(self, path: str, *, step: int, extra: Optional[Dict[str, Any]] = None) -> None:
        checkpoint.save(path, step=step, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                        ps=self.parallel_state, extra=extra)
        save_hf = self.config.model.save_hf
        if save_hf:
            self.save_hf(save_hf)

    def save_hf(self, path: str) -> None:
        """``--save-hf``: a Hugging Face directory (safetensors + config), written by rank 0;
        collective (TP shards are gathered)."""
        self.bridge.save_weights([self.model], path)
        dist.barrier()

    def load_checkpoint(self, path: str) -> Dict[str, Any]:
        return checkpoint.load(path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                               ps=self.parallel_state, hf_dir=self.hf_dir)

    # -- reference model (--use-kl-loss) -----------------------------------------------------
    def _reference_model(self):
        """A frozen copy of the starting weights (``--hf-checkpoint``), built on first use."""
        if self._ref_model is None:
            from rl_plugin.backends.megatron.bridge import build_gpt_model

            ref = build_gpt_model(self.bridge)
            if torch.cuda.is_available():
                ref.cuda(torch.cuda.current_device())
            self.bridge.load_weights([ref], self.hf_dir)
            for p in ref.parameters():
                p.requires_grad_(False)
            self._ref_model = ref
        return self._ref_model
