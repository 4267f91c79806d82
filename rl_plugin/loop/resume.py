"""Resume and save: what a checkpoint holds beyond the backend's files, and the resume command.

``load_train_state`` restores a ``--load`` checkpoint into the train group (every rank, the
backend's files); the run then restores the rollout manager (its dataset position), the loop
(step, next rollout, samples seen) and, under overlapped training, hands the rollout generated
ahead (``read_pending``: a ``PendingRollout``) to its schedule. ``save_checkpoint`` writes one
with the layout of ``rl_plugin.checkpoint`` (stage, every rank writes, then
``loop_state.json``, rename, tracker). ``resume_command`` / ``resume_hint`` are the lines the
run prints when it stops.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from rl_plugin.checkpoint.commit import begin_save, commit_save, retain
from rl_plugin.checkpoint.layout import latest_step, step_dir
from rl_plugin.checkpoint.pending_rollout import (
    PENDING_ROLLOUT,
    PendingRollout,
    read_pending_rollout,
    write_pending_rollout,
)
from rl_plugin.errors import LoopError, RLArgumentError
from rl_plugin.loop.config import LoopConfig
from rl_plugin.loop.logger import supersede_after
from rl_plugin.ray.train_group import TrainActorError, TrainGroup


@dataclass
class Progress:
    """Where the run stands: optimizer steps done, the next rollout, samples trained on."""

    step: int = 0
    start_rollout: int = 0
    samples_seen: int = 0  # samples consumed by optimizer steps so far (global, all DP ranks)


def resume_command(argv: Sequence[str], load_dir: str, critic_load: Optional[str] = None) -> str:
    """The command line that resumes this run: ``argv`` with ``--load load_dir`` (replacing any
    ``--load`` and dropping ``--overwrite-save``); given ``critic_load`` (PPO's ``--critic-save``),
    ``--critic-load critic_load`` too, replacing any, so the critic resumes with the actor."""
    replaced = ("--load", "--critic-load") if critic_load else ("--load",)
    out, skip = [], False
    for tok in argv:
        if skip:
            skip = False
            continue
        if tok in replaced:
            skip = True
            continue
        if tok.startswith(tuple(f"{name}=" for name in replaced)) or tok == "--overwrite-save":
            continue
        out.append(tok)
    tail = ["--critic-load", str(critic_load)] if critic_load else []
    return shlex.join(["rl-plugin-train", *out, "--load", str(load_dir), *tail])


def resume_hint(cfg: LoopConfig, argv: Sequence[str]) -> str:
    """Where the completed steps are and how to resume (or why one cannot)."""
    written = cfg.metrics_file.is_file() and cfg.metrics_file.stat().st_size > 0
    steps = f"Completed steps are in {cfg.metrics_file}" if written else "No step was completed"
    if cfg.save and latest_step(cfg.save) is not None:
        return (
            f"{steps}; resume with --load {cfg.save} (last checkpoint: step {latest_step(cfg.save)}): "
            f"{resume_command(argv, cfg.save, cfg.critic_save)}"
        )
    if cfg.save:
        return f"{steps}; no checkpoint was written yet, so a new run starts from the beginning"
    return f"{steps}; no checkpoint was written (pass --save DIR --save-interval N to make runs resumable)"


def load_train_state(group: TrainGroup, load_dir: str, step: int) -> Dict[str, Any]:
    """Every rank loads ``iter_{step}``; returns rank 0's metadata (step, the loop's ``extra``).
    A checkpoint that does not fit this run (another model, another layout) is an argument error
    with the backend's message (it names the checkpoint, the model and the fix)."""
    try:
        metas = group.load(step_dir(load_dir, step))
    except TrainActorError as exc:
        if exc.died or not exc.error_line:
            raise
        raise RLArgumentError(exc.error_line.split(": ", 1)[-1]) from None
    return metas[0]


def read_pending(cfg: LoopConfig, step: int, start_rollout: int, rollout_batch_size: int) -> Optional[PendingRollout]:
    """The rollout generated before the checkpoint and not trained on yet (None: none)."""
    pending = read_pending_rollout(cfg.load, step)
    if pending is None:
        return None
    if pending.rollout_id != start_rollout:
        raise LoopError(
            f"{step_dir(cfg.load, step)}/{PENDING_ROLLOUT} holds rollout {pending.rollout_id}, but the checkpoint's "
            f"next rollout is {start_rollout}: the checkpoint is inconsistent; resume from an earlier one"
        )
    print(
        f"resuming: rollout {start_rollout} was generated ahead before the checkpoint and is trained on as it was "
        f"(staleness {pending.staleness})",
        flush=True,
    )
    if pending.data.num_groups != rollout_batch_size:
        print(
            f"note: that rollout has {pending.data.num_groups} prompt groups, generated with the interrupted run's "
            f"--rollout-batch-size; this run's {rollout_batch_size} applies from rollout {start_rollout + 1} on",
            flush=True,
        )
    return pending


def supersede_metrics(cfg: LoopConfig, step: int) -> None:
    """Lines the interrupted run wrote past the checkpoint move to ``*.superseded.jsonl``."""
    moved = supersede_after(cfg.metrics_file, step)
    if moved:
        print(
            f"{cfg.metrics_file}: steps {moved[0]}-{moved[-1]} were written after the checkpoint by the interrupted run and "
            f"are trained again now; their lines moved to {cfg.metrics_file.stem}.superseded.jsonl",
            flush=True,
        )


def save_checkpoint(
    cfg: LoopConfig,
    group: TrainGroup,
    progress: Progress,
    rollout_id: int,
    dataset_state,
    pending: Optional[PendingRollout],
) -> None:
    """The checkpoint after rollout ``rollout_id``: ``dataset_state`` is the dataset position after
    its generate (training, sync and eval do not move it); overlapped, after rollout_id + 1's,
    which the checkpoint then holds (``pending_rollout.pt``)."""
    extra = {"rollout_id": rollout_id + 1, "rollout_state": dataset_state, "samples_seen": progress.samples_seen}
    staging = begin_save(cfg.save, progress.step)  # the layout: rl_plugin.checkpoint
    written = group.save(str(staging), progress.step, extra)
    state = {
        "step": progress.step,
        "next_rollout": rollout_id + 1,
        "samples_seen": progress.samples_seen,
        "train_backend": cfg.train_backend,
        "num_rollout": cfg.num_rollout,
        "settings": dict(cfg.run_settings),  # a resume with other settings names them (checkpoint.run_settings)
    }
    if pending is not None:  # overlapped: rollout_id + 1, generated ahead, is trained on at resume
        write_pending_rollout(staging, pending)
        state["pending_rollout"] = PENDING_ROLLOUT
    # every rank's files seen by this process, then loop_state.json, rename, tracker
    commit_save(cfg.save, progress.step, state, written, [i["ip"] for i in group.info])
    deleted = retain(cfg.save, cfg.save_retain, cfg.save_retain_interval)  # only once the new one is complete
    if deleted:
        print(f"--save-retain {cfg.save_retain}: deleted the checkpoints of steps {deleted}", flush=True)


def save_critic_checkpoint(
    root: str,
    critic: TrainGroup,
    progress: Progress,
    rollout_id: int,
    keep_last: Optional[int],
    keep_every: Optional[int],
) -> None:
    """PPO's critic after rollout ``rollout_id`` into ``root`` (``--critic-save``), at the actor's
    step number and with the same layout, written before the actor's checkpoint (whose commit is
    the resume point: a critic step without its actor's is never loaded); ``--save-retain`` as the
    actor's."""
    extra = {"rollout_id": rollout_id + 1, "role": "critic"}
    staging = begin_save(root, progress.step)
    written = critic.save(str(staging), progress.step, extra)
    state = {"step": progress.step, "next_rollout": rollout_id + 1, "role": "critic"}
    commit_save(root, progress.step, state, written, [i["ip"] for i in critic.info])
    retain(root, keep_last, keep_every)


def load_critic_state(critic: TrainGroup, load_dir: str, step: Optional[int]) -> Optional[int]:
    """PPO's critic from ``load_dir`` (``--critic-load``, default ``<--load>/critic``): the step
    the actor resumed (``step``), or, for an actor starting fresh (``step`` None), the directory's
    latest checkpoint if it has one. Returns the step loaded (None: none, a fresh value head). An
    actor step the critic's directory lacks is an argument error naming both and the fix."""
    latest = latest_step(load_dir)
    if step is None:
        if latest is None:
            return None
        step = latest
    elif not Path(step_dir(load_dir, step)).is_dir():
        raise RLArgumentError(
            f"--load resumes the actor at step {step}, but the critic's checkpoint directory {load_dir} holds no "
            f"step {step} (latest: {latest}): the actor and the critic must resume from the same rollout. Fix: pass "
            f"--critic-load DIR with the critic saved with that checkpoint (--critic-save), or --ckpt-step the "
            f"step both hold"
        )
    load_train_state(critic, load_dir, step)
    return step
