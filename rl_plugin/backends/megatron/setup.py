"""Start-up of the Megatron backend: parallel groups, model, DDP, optimizer, LR schedule.

Order (every rank, collectively; torch.distributed is already initialised):

Each step takes the typed config it needs (``rl_plugin.configs``), never the flags' namespace.

1. ``check_supported(model_cfg)``: CP > 1 and sequence parallelism need transformer-engine; an
   MoE model under TP > 1 needs sequence parallelism (megatron-core), and PP = 1 here.
2. ``init_parallel(model_cfg)``: megatron-core ``parallel_state`` (TP, CP, PP, EP, DP = the rest), the
   model-parallel RNG seeds, and the loss core's ``ParallelState`` built from megatron's groups.
3. ``build_model(model_cfg, hf_dir)``: mbridge bridge -> GPTModel (the interleaved schedule: one
   per model chunk, ``chunks.ModelChunks``), HF weights loaded, then
   ``Float16Module`` (``--bf16``) and megatron-core DDP (fp32 grad buffers). Without CUDA only
   (``cpu_shim``): the fusions off and ``rope_thd`` (packed RoPE without megatron-core's
   per-sample loop; bitwise the same); on a GPU megatron-core's defaults stand.
4. ``build_optimizer(optimizer_cfg, model)``: ``get_megatron_optimizer`` (Adam, ``--clip-grad``,
   ``--use-distributed-optimizer``) and ``OptimizerParamScheduler``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rl_plugin.backends.megatron import vision
from rl_plugin.backends.megatron.bridge import build_gpt_chunks, make_bridge, transformer_engine_available
from rl_plugin.backends.megatron.chunks import ModelChunks, chunks_of
from rl_plugin.configs import ModelConfig
from rl_plugin.configs import OptimizerConfig as RLOptimizerConfig
from rl_plugin.models.experts import checkpoint_num_experts
from rl_plugin.models.vl_processor import has_vision_config
from rl_plugin.parallel import ParallelState, cpu_group, virtual_pipeline_size

# TransformerConfig overrides on every device (the CPU-only ones, fusions off, are
# cpu_shim.cpu_config_overrides; CPU-side init when CUDA is absent). perform_initialization stays True although the checkpoint overwrites the
# weights: megatron-core 0.16.1 sets the TP attributes (tensor_model_parallel, partition_dim) only
# inside _initialize_affine_weight_{cpu,gpu} (tensor_parallel/layers.py l. 244, 855, 877), and
# without them the grad norm counts TP shards once and mbridge's export does not gather them.
_CONFIG_OVERRIDES = dict(
    perform_initialization=True,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


class MegatronSetupError(ValueError):
    """A flag combination the Megatron backend cannot run; the message names the flag and fix."""


def check_supported(cfg: ModelConfig) -> None:
    """Fail loud on layouts this installation cannot run (before any group or model is built)."""
    cp = cfg.context_parallel_size
    if cp > 1 and not transformer_engine_available():
        raise MegatronSetupError(
            f"--context-parallel-size {cp}: megatron-core context parallelism needs transformer-engine "
            "attention (TEDotProductAttention), and transformer-engine is not installed. Fix: install "
            "transformer-engine (a GPU machine), or use --context-parallel-size 1."
        )
    if cfg.sequence_parallel and not transformer_engine_available():
        raise MegatronSetupError(
            "--sequence-parallel: the local (non transformer-engine) layer spec uses torch norms, which "
            "megatron-core does not support under sequence parallelism (torch_norm.py asserts). Fix: install "
            "transformer-engine (a GPU machine), or drop --sequence-parallel."
        )
    tp = cfg.tensor_model_parallel_size
    if tp > 1 and not cfg.sequence_parallel and checkpoint_num_experts(cfg.hf_checkpoint):
        raise MegatronSetupError(
            f"--tensor-model-parallel-size {tp} with the mixture-of-experts model {cfg.hf_checkpoint}: megatron-core "
            "0.16.1 does not train an MoE layer under tensor parallelism without sequence parallelism "
            "(transformer/moe/moe_layer.py l. 379-383). Fix: --tensor-model-parallel-size 1 with "
            "--expert-model-parallel-size for the experts, or --sequence-parallel (needs transformer-engine)."
        )
    ep = cfg.moe.expert_model_parallel_size
    if ep > 1 and cfg.hf_checkpoint and not checkpoint_num_experts(cfg.hf_checkpoint):
        raise MegatronSetupError(
            f"--expert-model-parallel-size {ep} with {cfg.hf_checkpoint}: the model has no experts to split. "
            "Fix: drop --expert-model-parallel-size (data parallelism covers those ranks)."
        )
    pp = cfg.pipeline_model_parallel_size
    if pp > 1 and checkpoint_num_experts(cfg.hf_checkpoint):
        raise MegatronSetupError(
            f"--pipeline-model-parallel-size {pp} with the mixture-of-experts model {cfg.hf_checkpoint}: rl_plugin's "
            "Megatron backend does not yet run MoE layers inside a pipeline (the router losses are read on one "
            "stage, and the idle passes that keep expert parallelism's all-to-alls matched run on one stage "
            "only). Fix: --pipeline-model-parallel-size 1, with --expert-model-parallel-size for the experts."
        )


def check_true_on_policy(config, hf_dir: str) -> None:
    """What true on-policy mode (``TrainConfig.true_on_policy``, ``invariant_spec``) does not cover on
    this backend: it swaps the local layer spec's dense modules onto the op library, so MoE layers,
    LoRA adapters, the transformer-engine-only layouts (sequence / context parallelism), a TP size
    that does not divide the library's K chunks (row-parallel layers) and scaled RoPE would leave
    ops outside it or give other bits; pipeline parallelism is not verified under the mode."""
    from transformers import AutoConfig

    from rl_plugin.invariant import K_PARTS

    m = config.model
    tp = m.tensor_model_parallel_size
    rope = dict(getattr(AutoConfig.from_pretrained(hf_dir), "rope_parameters", None) or {})
    refusals = (
        (
            checkpoint_num_experts(hf_dir),
            f"the mixture-of-experts model {hf_dir} (its router and experts are not on the op library)",
            "a dense model (Llama, Qwen2, Qwen3, Mistral)",
        ),
        (
            K_PARTS % tp,
            f"--tensor-model-parallel-size {tp} (a row-parallel layer splits K into rl_plugin.invariant.K_PARTS = "
            f"{K_PARTS} chunks; TP must divide it)",
            f"--tensor-model-parallel-size {' or '.join(str(t) for t in range(1, K_PARTS + 1) if K_PARTS % t == 0)}",
        ),
        (
            rope.get("rope_type", "default") != "default",
            f"the RoPE type {rope.get('rope_type')!r} of {hf_dir} (megatron-core scales RoPE its own way)",
            "a model with default RoPE",
        ),
        (
            m.pipeline_model_parallel_size > 1,
            f"--pipeline-model-parallel-size {m.pipeline_model_parallel_size} (not verified bitwise under the mode)",
            "--pipeline-model-parallel-size 1",
        ),
        (config.lora.enabled, "--lora-rank (the adapters' matmuls are not on the op library)", "drop --lora-rank"),
        (m.sequence_parallel, "--sequence-parallel (the local layer spec runs without it)", "drop it"),
        (
            m.context_parallel_size > 1,
            f"--context-parallel-size {m.context_parallel_size} (the local layer spec runs without it)",
            "--context-parallel-size 1",
        ),
    )
    for refused, why, fix in refusals:
        if refused:
            raise MegatronSetupError(
                f"--true-on-policy-mode with {why}: the Megatron backend computes a dense model's local layer "
                f"spec through rl_plugin.invariant only. Fix: {fix}, or drop --true-on-policy-mode."
            )


def check_world(world: int, tp: int, cp: int, pp: int = 1) -> None:
    if world % (tp * cp * pp):
        raise MegatronSetupError(
            f"world size {world} is not a multiple of --tensor-model-parallel-size {tp} x "
            f"--context-parallel-size {cp} x --pipeline-model-parallel-size {pp}. Fix: launch a multiple of "
            f"{tp * cp * pp} training processes."
        )


def check_vocab(vocab_size: int, tp: int) -> None:
    if vocab_size % tp:
        raise MegatronSetupError(
            f"--tensor-model-parallel-size {tp}: the vocabulary ({vocab_size}) is not divisible by it, and "
            "padded vocab rows would enter the softmax. Fix: use a TP size that divides the vocab."
        )


def _group_or_none(group):
    return group if group is not None and dist.get_world_size(group) > 1 else None


def virtual_pipeline(cfg: ModelConfig, hf_dir: str):
    """The interleaved schedule's chunks per pipeline rank (None: one), from the model's layer count
    (``parallel.virtual_pipeline_size``: fails loud on a split that is not even, or one stage)."""
    if cfg.num_layers_per_virtual_pipeline_stage is None and cfg.num_virtual_stages_per_pipeline_rank is None:
        return None
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(hf_dir)
    layers = hf.num_hidden_layers  # make_bridge refuses multimodal configs
    return virtual_pipeline_size(
        int(layers),
        cfg.pipeline_model_parallel_size,
        layers_per_chunk=cfg.num_layers_per_virtual_pipeline_stage,
        chunks_per_rank=cfg.num_virtual_stages_per_pipeline_rank,
    )


def init_parallel(cfg: ModelConfig, vpp=None) -> ParallelState:
    """Megatron-core parallel state for (TP, CP, PP) with DP = world / (TP x CP x PP); returns ours.

    Devices (``rl_plugin.loss.runner``): the loss runs on the model's device, so the TP and CP
    groups are megatron's own (they carry device tensors: vocab-parallel scalars, GSPO sums, the
    CP gather); the DP and DP x CP groups carry CPU scalars (counts, plan, metrics): megatron's
    groups under gloo, gloo twins with the same ranks under NCCL (``parallel.cpu_group``).
    ``vpp``: the interleaved schedule's chunks per pipeline rank (``virtual_pipeline``), or None."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    tp, cp, pp = cfg.tensor_model_parallel_size, cfg.context_parallel_size, cfg.pipeline_model_parallel_size
    check_world(dist.get_world_size(), tp, cp, pp)
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=cfg.moe.expert_model_parallel_size,
        expert_tensor_parallel_size=cfg.moe.expert_tensor_parallel_size,
        virtual_pipeline_model_parallel_size=vpp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
    dp_g = cpu_group(mpu.get_data_parallel_group())  # the group itself under gloo
    cp_g = mpu.get_context_parallel_group()
    dp_cp_g = cpu_group(mpu.get_data_parallel_group(with_context_parallel=True))
    pp_g = mpu.get_pipeline_model_parallel_group()
    pp_cpu_g = cpu_group(pp_g)
    return ParallelState(
        pp_size=mpu.get_pipeline_model_parallel_world_size(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        pp_group=_group_or_none(pp_g),
        pp_cpu_group=_group_or_none(pp_cpu_g),
        pp_last_rank=mpu.get_pipeline_model_parallel_last_rank(),
        dp_size=mpu.get_data_parallel_world_size(),
        dp_rank=mpu.get_data_parallel_rank(),
        cp_size=mpu.get_context_parallel_world_size(),
        cp_rank=mpu.get_context_parallel_rank(),
        tp_size=mpu.get_tensor_model_parallel_world_size(),
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        dp_group=_group_or_none(dp_g),
        cp_group=_group_or_none(cp_g),
        tp_group=_group_or_none(mpu.get_tensor_model_parallel_group()),
        dp_cp_group=_group_or_none(dp_cp_g),
    )


def config_overrides(cfg: ModelConfig, *, cuda: bool) -> dict:
    """The ``TransformerConfig`` overrides rl_plugin passes to the bridge: ``_CONFIG_OVERRIDES``,
    the parallel layout, CPU-side init without CUDA, and the fusions off where a machine needs it
    (``cpu_shim.cpu_config_overrides``: all without CUDA, the masked-softmax fusion without
    transformer-engine)."""
    from rl_plugin.backends.megatron.compat.cpu_shim import cpu_config_overrides

    overrides = dict(_CONFIG_OVERRIDES)
    overrides.update(cpu_config_overrides(cuda, transformer_engine_available()))
    overrides.update(
        # pipeline: thd micro-batches differ in length, so the P2P ops exchange shapes first
        variable_seq_lengths=True,
        sequence_parallel=cfg.sequence_parallel,
        use_cpu_initialization=not cuda,
        context_parallel_size=cfg.context_parallel_size,
    )
    return overrides


def build_model(
    cfg: ModelConfig,
    hf_dir: str,
    *,
    use_distributed_optimizer: bool = False,
    routing_replay: bool = False,
    lora=None,
    value_head: bool = False,
    true_on_policy: bool = False,
    freeze_vision_tower: bool = False,
):
    """``(ddp_model, bridge)``: the GPTModel from ``hf_dir``, wrapped for training.
    ``routing_replay``: every MoE router gets megatron-core's ``RouterReplay``
    (``moe_enable_routing_replay``; ``rl_plugin.backends.megatron.routing_replay``).
    ``lora`` (a ``LoraConfig``, enabled): the local layer spec (megatron-core's own linears), the
    base frozen and the adapters added after the HF weights load and before DDP wraps the model
    (``lora_model.apply_lora``), so DDP and the optimizer see only the adapters.
    ``value_head``: the value model (``value_head.py``): the output layer replaced by the scalar
    head before the weights load, the backbone loaded by mbridge, the head from ``hf_dir``'s
    ``score.weight`` if it has one (zeros otherwise), the bridge naming it ``score.weight``.
    ``true_on_policy``: the local layer spec, its modules swapped onto the op library after the
    weights load (``invariant_spec.apply``).
    A vision-language checkpoint (``models.vl_processor.has_vision_config``) is built by ``vision.py`` (mbridge's
    Qwen2.5-VL on the local specs); ``freeze_vision_tower``: its vision tower out of training."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    from rl_plugin.backends.megatron.compat.cpu_shim import install_cpu_rope

    bf16 = cfg.bf16
    if cfg.fp16:
        raise MegatronSetupError("--fp16 is not supported by rl_plugin's Megatron backend. Fix: use --bf16.")
    cuda = torch.cuda.is_available()
    install_cpu_rope(cuda)  # CPU only: megatron-core's unfused thd RoPE without its per-sample loop (bitwise equal)
    overrides = config_overrides(cfg, cuda=cuda)
    if routing_replay:
        overrides["moe_enable_routing_replay"] = True
    use_lora = lora is not None and lora.enabled
    dtype = torch.bfloat16 if bf16 else torch.float32
    if has_vision_config(hf_dir):
        bridge = vision.make_vl_bridge(hf_dir, dtype=dtype, extra_config=overrides)
        check_vocab(bridge.hf_config.text_config.vocab_size, cfg.tensor_model_parallel_size)
        chunks = vision.build_vl_chunks(bridge)
    else:
        bridge = make_bridge(
            hf_dir,
            dtype=dtype,
            extra_config=overrides,
            moe=cfg.moe,
            use_te=False if use_lora or true_on_policy else None,
        )
        check_vocab(bridge.hf_config.vocab_size, cfg.tensor_model_parallel_size)
        chunks = build_gpt_chunks(bridge)
    if torch.cuda.is_available():
        for chunk in chunks:
            chunk.cuda(torch.cuda.current_device())
    if value_head:
        from rl_plugin.backends.megatron import value_head as vh

        vh.attach_value_heads(chunks)
        with vh.heads_detached(chunks):
            bridge.load_weights(chunks, hf_dir)
        vh.load_score(chunks, hf_dir)
        vh.value_bridge(bridge)
    else:
        bridge.load_weights(chunks, hf_dir)
    if true_on_policy:
        from rl_plugin.backends.megatron import invariant_spec

        invariant_spec.apply(chunks)
    if freeze_vision_tower:
        vision.freeze_vision_tower(chunks)
    if use_lora:
        from rl_plugin.backends.megatron.lora_model import apply_lora

        apply_lora(chunks, lora, seed=cfg.seed)
    config = bridge.config
    if bf16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    ddps = []
    for chunk in chunks:
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk)
        ddp.broadcast_params()
        ddps.append(ddp)
    return (ddps[0] if len(ddps) == 1 else ModelChunks(ddps)), bridge


def build_optimizer(opt: RLOptimizerConfig, model, total_steps: int = 10**9, *, bf16: bool = False):
    """``(optimizer, scheduler)`` for the DDP model (Megatron-LM's flags and defaults)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from rl_plugin.backends.megatron.compat import one_rank_collectives

    # gloo's one-rank all-reduces (grad norm; DDP grads at DP 1) cost ~0.5 ms each and are skipped,
    # bitwise equal; NCCL's cost microseconds, so megatron-core stays untouched on GPU machines
    if not torch.cuda.is_available():
        one_rank_collectives.install()

    cfg = OptimizerConfig(
        optimizer=opt.optimizer,
        sgd_momentum=opt.sgd_momentum,
        lr=opt.lr,
        min_lr=opt.min_lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=opt.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(cfg, chunks_of(model))
    decay = opt.lr_decay_iters or total_steps
    warmup = opt.lr_warmup_iters
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup else opt.lr,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(int(decay), warmup + 1),
        lr_decay_style=opt.lr_decay_style,
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=max(int(decay), 1),
        wd_incr_style="constant",
    )
    return optimizer, scheduler
