"""``MegatronBackend``: the ``TrainBackend`` on megatron-core (one instance per training process).

    backend = MegatronBackend.from_config(cfg)  # a TrainConfig; torch.distributed already initialised
    old = backend.compute_log_probs(batch)       # forward only, actor (or role="ref"): the runner
    report = backend.train_step(batch, num_groups=P)   # the runner (rl_plugin.loss.runner)
    hf = backend.export_hf_state_dict()          # TP-gathered, HF names, every rank
    stream = backend.stream_hf_weights()         # the weight sync's: collective, only rank 0 gets tensors
    backend.save_checkpoint(dir, step=k); backend.load_checkpoint(dir)

See ``setup.py`` (start-up), ``step.py`` (forward, schedule, optimizer step; why the step
applies exactly dJ/dtheta),
``forward.py`` (inputs and logits, ``--fp32-lm-head``), ``bridge.py`` (mbridge),
``checkpoint.py`` and ``cpu_shim.py`` (CPU / gloo).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from rl_plugin.backends.base import TrainBackend
from rl_plugin.backends.megatron import checkpoint, moe, pipeline_export, setup, step
from rl_plugin.backends.megatron.bridge import export_hf, hf_specs, stream_hf
from rl_plugin.backends.megatron.chunks import ModelChunks, chunks_of
from rl_plugin.backends.megatron.compat.cpu_shim import apply_cpu_shim
from rl_plugin.backends.megatron.forward import fused_head_unsupported, unwrap
from rl_plugin.configs import ModelConfig, TrainConfig
from rl_plugin.loss import ForwardOptions, StepRunner
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
        self.fused_lm_head = use_fused_head(config.model, chunks_of(model)[-1])  # the head's chunk
        self._ref_model = None
        self._teacher_model = None  # --use-opd --opd-type megatron, built on first use
        self._pipeline_specs = None  # pipelined: every stage's export layout, asked once
        self.loss_device = next(model.parameters()).device  # the logits' device: the loss runs there
        self.runner = StepRunner(
            self,
            micro_batch_size=config.batching.micro_batch_size,
            max_tokens_per_gpu=config.batching.max_tokens_per_gpu,
        )
        config = bridge.config
        # What Megatron-LM's training loop sets: the schedule calls these.
        from megatron.core.distributed import finalize_model_grads

        config.no_sync_func = model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = step.PassScale(optimizer.scale_loss)
        # expert parallelism: every rank runs the same number of passes (step.py)
        self.pass_scale = config.grad_scale_func if config.expert_model_parallel_size > 1 else None
        self.moe_layers = moe.num_moe_layers(model)
        self._real_micro_batches = 0

    @classmethod
    def from_config(cls, config: TrainConfig) -> "MegatronBackend":
        if not dist.is_initialized():
            raise RuntimeError(
                "MegatronBackend.from_config: initialise torch.distributed first (gloo on CPU, nccl on GPU)"
            )
        apply_cpu_shim()  # no-op where CUDA is present
        m, opt = config.model, config.optimizer
        setup.check_supported(m)
        hf_dir = m.hf_checkpoint or default_tiny_checkpoint()
        ps = setup.init_parallel(m, setup.virtual_pipeline(m, hf_dir))
        model, bridge = setup.build_model(
            m,
            hf_dir,
            use_distributed_optimizer=opt.use_distributed_optimizer,
            routing_replay=bool(config.routing_replay),
        )
        optimizer, scheduler = setup.build_optimizer(opt, model, bf16=m.bf16)
        return cls(config, model, bridge, optimizer, scheduler, ps, hf_dir)

    # -- the runner's backend interface (rl_plugin.loss.StepBackend) -----------------------------
    def forward(self, model, inputs, options: ForwardOptions) -> torch.Tensor:
        return step.micro_batch_forward(
            model,
            inputs,
            options,
            self.parallel_state,
            self.loss_device,
            qkv_format=self.loss_config.qkv_format,
            fp32_lm_head=self.fp32_lm_head,
            fused=self.fused_lm_head,
            idle_passes=self.pass_scale is not None,
            routing=self.routing_pass,
        )

    def new_routing_pass(self, action: str):
        from rl_plugin.routing.megatron_replay import RoutingPass

        ps = self.parallel_state
        return RoutingPass(
            action, tp_rank=ps.tp_rank, tp_size=ps.tp_size, sequence_parallel=self.config.model.sequence_parallel
        )

    def train_step(self, batch, *, num_groups: int, micro_batches=None, old_from_forward: bool = False):
        """The base step, plus the MoE router losses of the step (``moe_<name>``, ``moe.aux_loss_metrics``)."""
        if self.moe_layers:
            moe.clear_tracker()
        report = super().train_step(
            batch, num_groups=num_groups, micro_batches=micro_batches, old_from_forward=old_from_forward
        )
        if self.moe_layers:
            report.update(
                moe.aux_loss_metrics(self.bridge.config, self.moe_layers, self._real_micro_batches, self.parallel_state)
            )
        return report

    def schedule(self, model, num_micro_batches: int, forward, loss, *, forward_only: bool) -> int:
        if not forward_only:
            self._real_micro_batches = num_micro_batches
        return step.run_schedule(
            model,
            self.optimizer,
            self.parallel_state,
            num_micro_batches,
            forward,
            loss,
            forward_only=forward_only,
            pass_scale=self.pass_scale,
        )

    def optimizer_step(self) -> Tuple[float, float]:
        return step.optimizer_step(self.optimizer, self.scheduler)

    def model_for(self, role: str):
        if role == "teacher":
            return self._teacher()
        return self.model if role == "actor" else self._reference_model()

    def export_hf_state_dict(self) -> Dict[str, torch.Tensor]:
        return {name: t.detach().to("cpu").clone() for name, t in export_hf(self.bridge, self.model)}

    def hf_weight_specs(self) -> Optional[Dict[str, torch.Tensor]]:
        ps = self.parallel_state
        if ps.pp_size > 1:
            return pipeline_export.pipeline_specs(self._stage_specs())
        return hf_specs(self.bridge, self.model)

    def _stage_specs(self):
        """Every pipeline stage's export layout (``pipeline_export.all_stage_specs``): collective
        over the pipeline the first time, then kept (the layout never changes)."""
        if self._pipeline_specs is None:
            ps = self.parallel_state
            self._pipeline_specs = pipeline_export.all_stage_specs(self.bridge, self._cores(), ps.pp_cpu_group)
        return self._pipeline_specs

    def _cores(self):
        """The GPTModel of each of this rank's model chunks (one without the interleaved schedule)."""
        return [unwrap(chunk) for chunk in chunks_of(self.model)]

    def stream_hf_weights(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """Only the TP group of DP rank 0 gathers, to global rank 0 alone (``bridge.stream_hf``);
        pipelined, each stage's TP rank 0 sends its tensors on to global rank 0 in bounded messages
        (``pipeline_export.stream_gathered_to_rank0``: the fallback, not a per-stage publish)."""
        ps = self.parallel_state
        if ps.pp_size > 1:
            return pipeline_export.stream_gathered_to_rank0(
                self.bridge,
                self._cores(),
                self._stage_specs(),
                dp_rank=ps.dp_rank,
                cp_rank=ps.cp_rank,
                pp_group=ps.pp_group,
            )
        return stream_hf(self.bridge, self.model, dp_rank=ps.dp_rank, cp_rank=ps.cp_rank)

    def save_checkpoint(self, path: str, *, step: int, extra: Optional[Dict[str, Any]] = None) -> List[str]:
        written = checkpoint.save(
            path,
            step=step,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            ps=self.parallel_state,
            extra=extra,
        )
        save_hf = self.config.model.save_hf
        if save_hf:
            self.save_hf(save_hf)
        return written

    def save_hf(self, path: str) -> None:
        """``--save-hf``: a Hugging Face directory (safetensors + config), written by rank 0;
        collective (TP shards are gathered; pipeline stages broadcast theirs, under no_grad)."""
        with torch.no_grad():
            self.bridge.save_weights(chunks_of(self.model), path)
        if dist.get_rank() == 0 and self.hf_dir:  # tokenizer, chat template, ...: as FSDP's --save-hf
            import shutil
            from pathlib import Path

            for src in sorted(Path(self.hf_dir).iterdir()):
                dst = Path(path) / src.name
                if (
                    src.is_file()
                    and not dst.exists()
                    and not src.name.endswith((".safetensors", ".bin", ".pt", ".pth", ".index.json"))
                ):
                    shutil.copy(src, dst)
        dist.barrier()

    def load_checkpoint(self, path: str) -> Dict[str, Any]:
        return checkpoint.load(
            path,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            ps=self.parallel_state,
            hf_dir=self.hf_dir,
        )

    # -- reference model (--use-kl-loss) -----------------------------------------------------
    def _reference_model(self):
        """A frozen copy of the starting weights (``--hf-checkpoint``), built on first use."""
        if self._ref_model is None:
            self._ref_model = self._frozen_model(self.hf_dir)
        return self._ref_model

    def _teacher(self):
        """The OPD teacher (``--opd-teacher-load``), built on first use with the policy's layout:
        the same architecture (other sizes: ``--opd-type hf`` / ``vllm``, checked in preflight)."""
        if self._teacher_model is None:
            self._teacher_model = self._frozen_model(self.config.loss.opd_teacher_load)
        return self._teacher_model

    def _frozen_model(self, hf_dir: str):
        from rl_plugin.backends.megatron.bridge import build_gpt_chunks

        chunks = build_gpt_chunks(self.bridge)
        if torch.cuda.is_available():
            for chunk in chunks:
                chunk.cuda(torch.cuda.current_device())
        self.bridge.load_weights(chunks, hf_dir)
        model = chunks[0] if len(chunks) == 1 else ModelChunks(chunks)
        for p in model.parameters():
            p.requires_grad_(False)
        return model
