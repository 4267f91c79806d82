"""TRL's GRPOTrainer configured to match ``rl-plugin-train``'s defaults, shared by the
benchmarks that run it as the baseline (``vs_trl``, ``real_model``): one optimizer step per
generation of ``prompts x samples``, constant lr, AdamW (0.9, 0.98, 1e-8, no weight decay), clip
norm 1, no KL (beta 0), PPO clip 0.2 / 0.28, per-group reward scaling, T = 1, no top-p / top-k,
fp32 on the CPU, no checkpoints or logging integrations."""

from __future__ import annotations


def matched_grpo_config(
    output_dir: str,
    *,
    steps: int,
    prompts: int,
    samples: int,
    response_len: int,
    lr: float,
    seed: int,
    loss_type: str = "grpo",
):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=prompts * samples,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=samples,
        max_completion_length=response_len,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.98,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type=loss_type,
        scale_rewards="group",
        num_iterations=1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=seed,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
