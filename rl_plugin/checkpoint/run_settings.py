"""The run settings a checkpoint records (``loop_state.json``'s ``settings``), and the note a
resumed run prints when they changed.

A resumed run may change them on purpose (a larger batch, a new data file), so a change is not
refused; but it changes what the next steps train on, so the resume names what changed:
``--prompt-data`` (the dataset position is kept, in the new file), ``--rollout-batch-size``,
``--n-samples-per-prompt``, ``--global-batch-size``, ``--loss-aggregation`` (resolved),
``--advantage-estimator``. Read by argparse dest from the parsed flags; a checkpoint written
before the settings were recorded gives no note.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

RESUME_SETTINGS: Tuple[Tuple[str, str], ...] = (
    ("--prompt-data", "prompt_data"),
    ("--rollout-batch-size", "rollout_batch_size"),
    ("--n-samples-per-prompt", "n_samples_per_prompt"),
    ("--global-batch-size", "global_batch_size"),
    ("--loss-aggregation", "loss_aggregation"),
    ("--advantage-estimator", "advantage_estimator"),
)


def settings_of(args) -> Tuple[Tuple[str, Any], ...]:
    """(flag, value) of ``RESUME_SETTINGS`` (a tuple: a frozen config holds it; JSON as a dict)."""
    return tuple((flag, getattr(args, dest, None)) for flag, dest in RESUME_SETTINGS)


def changed_settings(saved: Optional[Dict[str, Any]], args) -> List[str]:
    """``"--flag OLD -> NEW"`` for each recorded setting that differs now (none without a record)."""
    if not saved:
        return []
    return [f"{flag} {saved[flag]} -> {now}" for flag, now in settings_of(args) if flag in saved and saved[flag] != now]


def resume_note(load: str, step: int, saved: Optional[Dict[str, Any]], args) -> Optional[str]:
    changes = changed_settings(saved, args)
    if not changes:
        return None
    return (
        f"note: --load {load} (step {step}) was trained with other settings; this run goes on with the new ones: "
        f"{'; '.join(changes)}. The model, optimizer, step and dataset position (epoch, offset) are kept as saved"
    )
