"""The run settings a checkpoint records (``loop_state.json``'s ``settings``), and the note a
resumed run prints when they changed.

A resumed run may change them on purpose (a larger batch, a new data file), so a change is not
refused; but it changes what the next steps train on, so the resume names what changed:
``--prompt-data`` (the dataset position is kept, in the new file), ``--rollout-batch-size``,
``--n-samples-per-prompt``, ``--global-batch-size``, ``--loss-aggregation`` (resolved),
``--advantage-estimator``, and PPO's critic settings that change the advantages and the value
targets (``--gamma``, ``--lambd``, ``--value-clip``, ``--kl-coef``, ``--normalize-advantages``,
``--critic-lr``). Read off the run config's declared fields (each flag's name is its
field's: ``rl_plugin.flags.flag_of``); a checkpoint written before the settings were recorded
gives no note.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from rl_plugin.flags import flag_of

# (where the value is in the run config, the field that declares its flag when not the value's own)
RESUME_SETTINGS: Tuple[Tuple[str, Optional[str]], ...] = (
    ("rollout.prompt_data", None),
    ("train.batching.rollout_batch_size", None),
    ("train.batching.n_samples_per_prompt", None),
    ("train.batching.global_batch_size", None),
    ("train.loss.loss_aggregation", "loss_aggregation_flag"),  # the resolved mode, under --loss-aggregation
    ("train.loss.advantage_estimator", None),
    ("critic.gamma", None),
    ("critic.lambd", None),
    ("critic.value_clip", None),
    ("critic.kl_coef", None),
    ("critic.normalize_advantages", None),
    ("critic.critic_lr", None),
)


def _setting(run, path: str, declared: Optional[str]) -> Tuple[str, Any]:
    *parents, name = path.split(".")
    config = run
    for part in parents:
        config = getattr(config, part)
    return flag_of(type(config), declared or name).names[0], getattr(config, name)


def settings_of(run) -> Tuple[Tuple[str, Any], ...]:
    """(flag, value) of ``RESUME_SETTINGS`` in the ``RunConfig`` ``run`` (a tuple: a frozen config
    holds it; JSON as a dict)."""
    return tuple(_setting(run, path, declared) for path, declared in RESUME_SETTINGS)


def changed_settings(saved: Optional[Dict[str, Any]], run) -> List[str]:
    """``"--flag OLD -> NEW"`` for each recorded setting that differs now (none without a record)."""
    if not saved:
        return []
    return [f"{flag} {saved[flag]} -> {now}" for flag, now in settings_of(run) if flag in saved and saved[flag] != now]


def resume_note(load: str, step: int, saved: Optional[Dict[str, Any]], run) -> Optional[str]:
    changes = changed_settings(saved, run)
    if not changes:
        return None
    return (
        f"note: --load {load} (step {step}) was trained with other settings; this run goes on with the new ones: "
        f"{'; '.join(changes)}. The model, optimizer, step and dataset position (epoch, offset) are kept as saved"
    )
