"""``MegatronBackend``: the ``TrainBackend`` on megatron-core (one instance per training process).

    backend = MegatronBackend.from_config(cfg)  # a TrainConfig; torch.distributed already initialised
    old = backend.compute_log_probs(batch)       # forward only, actor (or role="ref"): the runner
    report = backend.train_step(batch, num_groups=P)   # the runner (rl_plugin.loss.runner)
    hf = backend.export_hf_state_dict()          # TP-gathered, HF names, every rank
    stream = backend.stream_hf_weights()         # the weight sync's: collective, only rank 0 gets tensors
    backend.save_checkpoint(dir, step=k); backend.load_checkpoint(dir)

With ``--lora-rank`` (``lora_model.py``, ``lora.py``): the base frozen, adapters on the targeted
linears; the reference model is the actor with its adapters off; ``stream_lora_adapters`` yields
the adapters (canonical PEFT names, full fp32), ``stream_hf_weights`` / ``export_hf_state_dict`` /
``save_hf`` the merged weights ``W + (alpha/r) B A`` (the full-model sync's fallback); checkpoints
hold the adapters and their optimizer state only (``lora_checkpoint.py``).

With ``TrainConfig.value_head`` it is the VALUE MODEL (``value_head.py``, issue 47): the actor's
GPTModel with a scalar head ``score.weight`` instead of the LM head, its own optimizer;
``forward`` with ``options.values`` gives ``[n, 1]`` values, ``model_for("critic")`` the model,
exports name it as HF's ``<Family>ForTokenClassification`` (``model.*``, ``score.weight``), and
``--save-hf`` writes a directory ``AutoModelForTokenClassification`` loads.

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
from rl_plugin.backends.megatron import checkpoint, lora_export, lora_model, moe, pipeline_export, setup, step, vision
from rl_plugin.backends.megatron.bridge import export_hf, hf_specs, stream_hf
from rl_plugin.backends.megatron.chunks import ModelChunks, chunks_of
from rl_plugin.backends.megatron.compat.cpu_shim import apply_cpu_shim
from rl_plugin.backends.megatron.forward import fused_head_unsupported, unwrap
from rl_plugin.configs import ModelConfig, TrainConfig
from rl_plugin.loss import ForwardOptions, StepRunner
from rl_plugin.models.tiny import default_tiny_checkpoint
from rl_plugin.models.vl_processor import has_vision_config
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
        self.value_head = config.value_head  # the value model: no LM head to fuse
        self.fused_lm_head = not self.value_head and use_fused_head(config.model, chunks_of(model)[-1])
        self._ref_model = None
        self._teacher_model = None  # --use-opd --opd-type megatron, built on first use
        self._pipeline_specs = None  # pipelined: every stage's export layout, asked once
        self._lora_specs = None  # LoRA: every stage's adapter layout, asked once
        self.lora = config.lora.enabled
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
        apply_cpu_shim()  # what this machine needs: nothing on a GPU with transformer-engine
        m, opt = config.model, config.optimizer
        setup.check_supported(m)
        if config.value_head and config.lora.enabled:
            raise setup.MegatronSetupError(
                "the value model (--advantage-estimator ppo's critic) with --lora-rank: the critic trains every "
                "parameter and has no adapters. Fix: the critic's TrainConfig (run.critic_train) with LoRA off"
            )
        hf_dir = m.hf_checkpoint or default_tiny_checkpoint()
        if has_vision_config(hf_dir):
            vision.check_vl_layout(config)
        if config.true_on_policy:
            setup.check_true_on_policy(config, hf_dir)
        if config.lora.enabled:
            from rl_plugin.models.experts import checkpoint_num_experts

            lora_model.check_lora_supported(m, config.lora, num_experts=checkpoint_num_experts(hf_dir))
        ps = setup.init_parallel(m, setup.virtual_pipeline(m, hf_dir))
        model, bridge = setup.build_model(
            m,
            hf_dir,
            use_distributed_optimizer=opt.use_distributed_optimizer,
            routing_replay=bool(config.routing_replay),
            lora=config.lora,
            value_head=config.value_head,
            true_on_policy=config.true_on_policy,
            freeze_vision_tower=config.freeze_vision_tower,
        )
        if config.lora.enabled and config.lora.lora_adapter_path:  # before the optimizer copies its main params
            lora_model.load_adapters(model, read_peft_adapters(config.lora.lora_adapter_path))
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
        from rl_plugin.backends.megatron.routing_replay import RoutingPass

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
                moe.aux_loss_metrics(
                    self.bridge.config,
                    self.moe_layers,
                    self._real_micro_batches,
                    self.parallel_state,
                    device=self.loss_device,
                )
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
        if self.value_head:
            if role not in ("critic", "actor"):
                raise ValueError(f"the value model has no {role!r} model (only 'critic')")
            return self.model
        if role == "teacher":
            return self._teacher()
        if role == "actor" or self.lora:  # LoRA: the reference is the actor with its adapters off
            return self.model
        return self._reference_model()

    def compute_log_probs(self, batch, *, role: str = "actor", micro_batches=None) -> torch.Tensor:
        """The base's; with LoRA, ``role="ref"`` runs the actor with its adapters disabled (the
        frozen base IS the ``--hf-checkpoint`` reference)."""
        if role == "ref" and self.lora:
            with lora_model.adapters_disabled(self.model):
                return super().compute_log_probs(batch, role=role, micro_batches=micro_batches)
        return super().compute_log_probs(batch, role=role, micro_batches=micro_batches)

    def deterministic_forward(self) -> bool:
        return not (self.lora and self.config.lora.lora_dropout > 0)

    def export_hf_state_dict(self) -> Dict[str, torch.Tensor]:
        """Full weights, HF names; with LoRA the merged ``W + (alpha/r) B A``."""
        with lora_model.base_view(self.model, merged=True):
            return {name: t.detach().to("cpu").clone() for name, t in export_hf(self.bridge, self.model)}

    def export_base_state_dict(self) -> Dict[str, torch.Tensor]:
        """The frozen base weights (adapters left out), HF names; without LoRA the model's."""
        with lora_model.base_view(self.model, merged=False):
            return {name: t.detach().to("cpu").clone() for name, t in export_hf(self.bridge, self.model)}

    def hf_weight_specs(self) -> Optional[Dict[str, torch.Tensor]]:
        ps = self.parallel_state
        if ps.pp_size > 1:
            return pipeline_export.pipeline_specs(self._stage_specs())
        with lora_model.base_view(self.model, merged=False):
            return hf_specs(self.bridge, self.model)

    # -- LoRA adapters (issue 34) ---------------------------------------------------------------
    def lora_adapter_specs(self) -> Dict[str, torch.Tensor]:
        """What ``stream_lora_adapters`` yields, as meta tensors in stream order (collective over
        the pipeline the first time)."""
        if self._lora_specs is None:
            self._lora_specs = lora_export.adapter_stage_specs(self.model, self.parallel_state.pp_cpu_group)
        return lora_export.adapter_specs(self._lora_specs)

    def stream_lora_adapters(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """``(canonical PEFT name, full fp32 CPU tensor)`` at global rank 0, like
        ``stream_hf_weights`` (``lora_export``); collective: every rank must exhaust it."""
        ps = self.parallel_state
        self.lora_adapter_specs()
        return lora_export.stream_adapters(
            self.model,
            self._lora_specs,
            dp_rank=ps.dp_rank,
            cp_rank=ps.cp_rank,
            tp_rank=ps.tp_rank,
            pp_rank=ps.pp_rank,
            pp_group=ps.pp_group,
        )

    def load_lora_adapters(self, tensors: Dict[str, torch.Tensor]) -> None:
        """Full adapters by canonical name (e.g. ``read_peft_adapters`` of a PEFT directory) into
        this rank's shards, and into the optimizer's fp32 main params."""
        lora_model.load_adapters(self.model, tensors)
        self.optimizer.reload_model_params()

    def _stage_specs(self):
        """Every pipeline stage's export layout (``pipeline_export.all_stage_specs``): collective
        over the pipeline the first time, then kept (the layout never changes)."""
        if self._pipeline_specs is None:
            ps = self.parallel_state
            with lora_model.base_view(self.model, merged=False):
                self._pipeline_specs = pipeline_export.all_stage_specs(self.bridge, self._cores(), ps.pp_cpu_group)
        return self._pipeline_specs

    def _cores(self):
        """The GPTModel of each of this rank's model chunks (one without the interleaved schedule)."""
        return [unwrap(chunk) for chunk in chunks_of(self.model)]

    def stream_hf_weights(self, *, host: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        """Only the TP group of DP rank 0 gathers, to global rank 0 alone (``bridge.stream_hf``);
        pipelined, each stage's TP rank 0 sends its tensors on to global rank 0 in bounded messages
        (``pipeline_export.stream_gathered_to_rank0``: the fallback, not a per-stage publish)."""
        ps = self.parallel_state
        if ps.pp_size > 1:
            self._stage_specs()

            def stream():
                return pipeline_export.stream_gathered_to_rank0(
                    self.bridge,
                    self._cores(),
                    self._stage_specs(),
                    dp_rank=ps.dp_rank,
                    cp_rank=ps.cp_rank,
                    pp_group=ps.pp_group,
                    host=host,
                )

        else:

            def stream():
                return stream_hf(self.bridge, self.model, dp_rank=ps.dp_rank, cp_rank=ps.cp_rank, host=host)

        if not self.lora:
            return stream()
        return lora_model.stream_in_view(self.model, stream, merged=True)  # the merged fallback

    def save_checkpoint(self, path: str, *, step: int, extra: Optional[Dict[str, Any]] = None) -> List[str]:
        from rl_plugin.checkpoint.lora_meta import lora_meta, write_lora_meta

        written = checkpoint.save(
            path,
            step=step,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            ps=self.parallel_state,
            extra=extra,
        )
        meta = lora_meta(self.config.lora, self.hf_dir)  # the adapters' lora.json, as the FSDP backend's
        if meta is not None and dist.get_rank() == 0:
            written = sorted(set(written) | {write_lora_meta(path, meta)})
        save_hf = self.config.model.save_hf
        if save_hf or (self.lora and self.config.lora.save_hf_merged):  # as FSDP's save_checkpoint
            self.save_hf(save_hf)
        return written

    def save_hf(self, path: Optional[str]) -> None:
        """``--save-hf``: a Hugging Face directory (safetensors + config), written by rank 0;
        collective (TP shards are gathered; pipeline stages broadcast theirs, under no_grad).
        With LoRA: a PEFT adapter directory (``--save-hf-merged DIR``: also the merged model there).
        The value model: ``models.value_head.write_value_hf_dir`` (a token-classification directory)."""
        if self.value_head:
            from rl_plugin.models.value_head import write_value_hf_dir

            state = self.export_hf_state_dict()  # collective
            if dist.get_rank() == 0:
                write_value_hf_dir(path, state, self.bridge.hf_config, source_dir=self.hf_dir)
            dist.barrier()
            return
        if self.lora:
            from rl_plugin.lora.peft_dir import write_run_adapters

            cfg = self.config.lora
            if path:  # --save-hf-merged alone: the merged model only
                adapters = dict(self.stream_lora_adapters())  # collective; rank 0 holds them
                if dist.get_rank() == 0:
                    write_run_adapters(path, adapters, cfg, str(self.hf_dir))
                dist.barrier()
            if not cfg.save_hf_merged:
                return
            path = cfg.save_hf_merged
        with torch.no_grad(), lora_model.base_view(self.model, merged=True):
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
        from rl_plugin.checkpoint.lora_meta import check_lora_meta, lora_meta

        check_lora_meta(str(path), lora_meta(self.config.lora, self.hf_dir))  # LoRA-ness, rank / alpha / targets, base
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
        if self.config.true_on_policy:
            from rl_plugin.backends.megatron import invariant_spec

            invariant_spec.apply(chunks)
        model = chunks[0] if len(chunks) == 1 else ModelChunks(chunks)
        for p in model.parameters():
            p.requires_grad_(False)
        return model


def read_peft_adapters(path: str) -> Dict[str, torch.Tensor]:
    """``--lora-adapter-path``: a PEFT directory's adapters by canonical name (``rl_plugin.lora.peft_dir``)."""
    from rl_plugin.lora.peft_dir import read_peft_dir

    return read_peft_dir(path)[1]
