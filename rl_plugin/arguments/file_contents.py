"""What the files the flags name hold, read before Ray starts: phase 1c, no world needed.

``check_file_contents(run)`` (on the ``RunConfig`` the flags build) is ONE function run by the trainer's preflight
(``rl_plugin.loop.preflight``, before Ray starts) and by the flag checker (``python -m
rl_plugin.arguments``, unless ``--no-file-checks``), so both refuse the same files with the same
one-line message (issue 44 item 25). After ``validate_paths`` (the files exist), it reads:

1. the checkpoint to resume (``check_resume_point``): written by this ``--train-backend``, not
   already at or past ``--num-rollout`` (``loop_state.json``), and, when LoRA is on either side,
   its adapters' shape and base model (``lora.json``), by the check the train ranks run at load
   (``rl_plugin.checkpoint.lora_meta.check_lora_meta``; the base fingerprint hashes the base's
   weight files, as the ranks do);
2. with ``--loss-type sft_loss``, every conversation of ``--prompt-data`` /
   ``--eval-prompt-data``: it reads, templates and fits the model's context
   (``rollout.data.prompt_check.check_sft_file``);
3. the ``--use-opd`` teacher (``opd_teacher.check_opd``).
4. with ``--multimodal-keys``: the checkpoint has a vision tower, and every record of the data
   files: its images open and its image tokens fit the context (``check_image_data``).

The data and the LoRA base need the model's directory: the flag checker on the embedded model
(built by the run, ``loop.embedded_setup``) skips them; the trainer builds it first and checks all.
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


def check_file_contents(run) -> Optional[ResumePoint]:
    """Raise ``RLArgumentError`` on the first bad file (module docstring); returns the resume point."""
    point = check_resume_point(run)
    if run.mode.trains_nll and run.train.model.hf_checkpoint is not None:
        check_sft_data(run)
    check_opd(run)
    if run.rollout.multimodal.image_key is not None:
        check_image_data(run)
    return point


def check_resume_point(run) -> Optional[ResumePoint]:
    load, backend_now = run.checkpoint.load, run.train.train_backend
    if not load:
        return None
    step = resume_step(load, run.checkpoint.ckpt_step)
    if step is None:
        return None
    d = step_dir(load, step)
    backend = written_by(load, step)
    if backend is not None and backend != backend_now:
        fail(
            f"--load {load} with --train-backend {backend_now}",
            f"its checkpoint at step {step} ({d}) was written by the {backend} backend, whose checkpoint format the "
            f"{backend_now} backend cannot read",
            f"resume with --train-backend {backend}; to move the model to the {backend_now} backend, export it from a "
            f"{backend} run with --save-hf DIR and start a new run from it with --hf-checkpoint DIR",
        )
    state = read_loop_state(load, step) or {}
    point = ResumePoint(step, state.get("next_rollout"))
    check_progress(run, point.next_rollout, step)
    check_lora_resume(run, str(d))
    return point


def check_progress(run, next_rollout: Optional[int], step: int) -> None:
    """A checkpoint past ``--num-rollout`` would train nothing: refuse, naming both numbers."""
    n = run.rollout.num_rollout
    if next_rollout is not None and next_rollout > n:
        fail(
            f"--load {run.checkpoint.load} with --num-rollout {n}",
            f"its checkpoint (step {step}) has already done {next_rollout} rollouts, more than --num-rollout, so this run would "
            "train nothing. --num-rollout counts all rollouts of the run, those before the checkpoint included",
            f"pass --num-rollout {next_rollout + n} to train {n} more rollouts",
        )


def check_lora_resume(run, directory: str) -> None:
    """The step directory's ``lora.json`` against this run's LoRA flags and base, by the ranks'
    own check (``checkpoint.lora_meta.check_lora_meta``, same message)."""
    from rl_plugin.checkpoint.lora_meta import check_lora_meta, lora_meta, read_lora_meta

    cfg, saved, hf_checkpoint = run.train.lora, read_lora_meta(directory), run.train.model.hf_checkpoint
    if not cfg.enabled and saved is None:
        return  # full model on both sides: nothing to compare (and no base to hash)
    if hf_checkpoint is None:
        return  # the flag checker on the embedded model, not built yet: the trainer checks it
    current = None
    if cfg.enabled and saved is None:
        current = {}  # LoRA on a full-model checkpoint: refused on LoRA-ness alone (no base to hash)
    elif cfg.enabled:
        current = lora_meta(cfg, hf_checkpoint)
    try:
        check_lora_meta(directory, current)
    except ValueError as exc:  # already "--load DIR: ... Fix: ...", as the ranks raise it
        raise RLArgumentError(str(exc)) from None


def check_sft_data(run) -> None:
    """Every conversation of ``--prompt-data`` / ``--eval-prompt-data`` (module docstring, 2)."""
    from rl_plugin.rollout.data.prompt_check import check_sft_file, model_context_length

    cfg, hf_checkpoint = run.rollout, run.train.model.hf_checkpoint
    files = [(f, p) for f, p in (("--prompt-data", cfg.prompt_data), ("--eval-prompt-data", cfg.eval_prompt_data)) if p]
    if not files:
        return
    tokenizer = run_tokenizer(run)
    context = model_context_length(hf_checkpoint)
    for flag, path in files:
        check_sft_file(
            flag,
            path,
            tokenizer,
            input_key=cfg.input_key,
            label_key=cfg.label_key,
            context_len=context,
            hf_checkpoint=hf_checkpoint,
            image_key=cfg.multimodal.image_key,
        )


def run_tokenizer(run):
    """The run's tokenizer as the rollout side templates with it (``rollout_prompts``), or a
    refusal naming ``--hf-checkpoint`` when its directory has no tokenizer."""
    from rl_plugin.rollout.data.vl_prompt import rollout_prompts

    hf_checkpoint = run.train.model.hf_checkpoint
    if run.rollout.multimodal.image_key is not None:
        from rl_plugin.rollout.data.image_check import check_vl_checkpoint

        check_vl_checkpoint(hf_checkpoint)  # named by its flag, before the processor is looked for
    try:
        return rollout_prompts(run.rollout, hf_checkpoint)
    except ValueError as exc:
        fail(f"--hf-checkpoint {hf_checkpoint}", str(exc), "point it at a model directory with its tokenizer files")


def check_image_data(run) -> None:
    """A ``--multimodal-keys`` run (module docstring, 4; ``rollout.data.image_check``)."""
    from rl_plugin.rollout.data.image_check import check_image_prompt_file, check_vl_checkpoint
    from rl_plugin.rollout.data.prompt_check import model_context_length

    cfg, hf_checkpoint = run.rollout, run.train.model.hf_checkpoint
    check_vl_checkpoint(hf_checkpoint)
    prompts = run_tokenizer(run)
    context = cfg.engine.max_context_len or model_context_length(hf_checkpoint)
    for flag, path in (("--prompt-data", cfg.prompt_data), ("--eval-prompt-data", cfg.eval_prompt_data)):
        if path is not None:
            check_image_prompt_file(
                flag,
                path,
                prompts,
                input_key=cfg.input_key,
                label_key=cfg.label_key,
                metadata_key=cfg.metadata_key,
                image_key=cfg.multimodal.image_key,
                max_response_len=cfg.rollout_max_response_len or 0,
                context_len=context,
                rm_type=cfg.rm_type,
            )
