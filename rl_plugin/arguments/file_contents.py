"""What the files the flags name hold, read before Ray starts: phase 1c, no world needed.

``check_file_contents(args)`` is ONE function run by the trainer's preflight
(``rl_plugin.loop.preflight``, before Ray starts) and by the flag checker (``python -m
rl_plugin.arguments``, unless ``--no-file-checks``), so both refuse the same files with the same
one-line message (issue 44 item 25). After ``validate_paths`` (the files exist), it reads:

1. the checkpoint to resume (``check_resume_point``): written by this ``--train-backend``, not
   already at or past ``--num-rollout`` (``loop_state.json``), and, when LoRA is on either side,
   its adapters' shape and base model (``lora.json``), by the check the train ranks run at load
   (``rl_plugin.checkpoint.lora_base.check_lora_meta``; the base fingerprint hashes the base's
   weight files, as the ranks do);
2. with ``--loss-type sft_loss``, every conversation of ``--prompt-data`` /
   ``--eval-prompt-data``: it reads, templates and fits the model's context
   (``rollout.data.prompt_check.check_sft_file``);
3. the ``--use-opd`` teacher (``opd_teacher.check_opd``).

The data and the LoRA base need the model's directory: the flag checker on the embedded model
(built by the run, ``loop.embedded``) skips them; the trainer builds it first and checks all.
The RL prompts are checked by the trainer's preflight only (``check_reward_and_data``: with the
reward function's import and the ``--rm-url`` probe, which need the user's code and the server).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rl_plugin.arguments.opd_teacher import check_opd
from rl_plugin.checkpoint.layout import read_loop_state, resume_step, step_dir, written_by
from rl_plugin.errors import RLArgumentError, fail


@dataclass
class ResumePoint:
    step: int
    next_rollout: Optional[int]  # None when the checkpoint predates loop_state.json


def check_file_contents(args) -> Optional[ResumePoint]:
    """Raise ``RLArgumentError`` on the first bad file (module docstring); returns the resume point."""
    point = check_resume_point(args)
    if args.loss_type == "sft_loss" and args.hf_checkpoint is not None:
        check_sft_data(args)
    check_opd(args)
    return point


def check_resume_point(args) -> Optional[ResumePoint]:
    if not args.load:
        return None
    step = resume_step(args.load, args.ckpt_step)
    if step is None:
        return None
    d = step_dir(args.load, step)
    backend = written_by(args.load, step)
    if backend is not None and backend != args.train_backend:
        fail(
            f"--load {args.load} with --train-backend {args.train_backend}",
            f"its checkpoint at step {step} ({d}) was written by the {backend} backend, whose checkpoint format the "
            f"{args.train_backend} backend cannot read",
            f"resume with --train-backend {backend}; to move the model to the {args.train_backend} backend, export it from a "
            f"{backend} run with --save-hf DIR and start a new run from it with --hf-checkpoint DIR",
        )
    state = read_loop_state(args.load, step) or {}
    point = ResumePoint(step, state.get("next_rollout"))
    check_progress(args, point.next_rollout, step)
    check_lora_resume(args, str(d))
    return point


def check_progress(args, next_rollout: Optional[int], step: int) -> None:
    """A checkpoint past ``--num-rollout`` would train nothing: refuse, naming both numbers."""
    if next_rollout is not None and next_rollout > args.num_rollout:
        fail(
            f"--load {args.load} with --num-rollout {args.num_rollout}",
            f"its checkpoint (step {step}) has already done {next_rollout} rollouts, more than --num-rollout, so this run would "
            "train nothing. --num-rollout counts all rollouts of the run, those before the checkpoint included",
            f"pass --num-rollout {next_rollout + args.num_rollout} to train {args.num_rollout} more rollouts",
        )


def check_lora_resume(args, directory: str) -> None:
    """The step directory's ``lora.json`` against this run's LoRA flags and base, by the ranks'
    own check (``checkpoint.lora_base.check_lora_meta``, same message)."""
    from rl_plugin.checkpoint.lora_base import check_lora_meta, lora_meta, read_lora_meta
    from rl_plugin.configs.lora import LoraConfig
    from rl_plugin.lora.targets import resolve_targets

    cfg, saved = LoraConfig.from_args(args), read_lora_meta(directory)
    if not cfg.enabled and saved is None:
        return  # full model on both sides: nothing to compare (and no base to hash)
    if args.hf_checkpoint is None:
        return  # the flag checker on the embedded model, not built yet: the trainer checks it
    current = None
    if cfg.enabled and saved is None:
        current = {}  # LoRA on a full-model checkpoint: refused on LoRA-ness alone (no base to hash)
    elif cfg.enabled:
        targets = resolve_targets(cfg.target_modules, cfg.exclude_modules)
        current = lora_meta(rank=cfg.lora_rank, alpha=cfg.lora_alpha, targets=targets, hf_dir=args.hf_checkpoint)
    try:
        check_lora_meta(directory, current)
    except ValueError as exc:  # already "--load DIR: ... Fix: ...", as the ranks raise it
        raise RLArgumentError(str(exc)) from None


def check_sft_data(args) -> None:
    """Every conversation of ``--prompt-data`` / ``--eval-prompt-data`` (module docstring, 2)."""
    from rl_plugin.rollout.data.prompt_check import check_sft_file, model_context_length
    from rl_plugin.rollout.data.tokenizer import load_tokenizer

    files = [
        (f, p) for f, p in (("--prompt-data", args.prompt_data), ("--eval-prompt-data", args.eval_prompt_data)) if p
    ]
    if not files:
        return
    try:
        tokenizer = load_tokenizer(
            args.hf_checkpoint,
            apply_chat_template=args.apply_chat_template,
            chat_template_kwargs=args.apply_chat_template_kwargs,
            system_prompt=args.system_prompt,
        )
    except ValueError as exc:
        fail(
            f"--hf-checkpoint {args.hf_checkpoint}", str(exc), "point it at a model directory with its tokenizer files"
        )
    context = model_context_length(args.hf_checkpoint)
    for flag, path in files:
        check_sft_file(
            flag,
            path,
            tokenizer,
            input_key=args.input_key,
            label_key=args.label_key,
            context_len=context,
            hf_checkpoint=args.hf_checkpoint,
        )
