"""Checks of the files and directories the flags name: phase 1b, no world needed.

``validate_paths(args)`` runs in ``python -m rl_plugin.arguments`` and in the first second of
``rl-plugin-train`` (before Ray starts), after ``validate_rl_args``. It is separate from
``validate_rl_args`` because a flag set is often checked on a machine that does not hold the files
(a laptop preparing a cluster job; Megatron-LM's ``extra_args_provider``).

Rules: ``--prompt-data`` / ``--eval-prompt-data`` are files; ``--hf-checkpoint`` holds a
``config.json``; ``--custom-rm-path`` names a file that compiles (a syntax error is reported at
its file:line) or an importable module (``rl_plugin.user_code.check_source``, the forms every
user-function flag takes); ``--load`` exists (an existing EMPTY directory means
"start fresh", a missing one is a typo) and is a ``--save`` directory, not one step inside it;
``--save`` holds no checkpoints of another run unless this run resumes them (``--load`` the same
directory) or ``--overwrite-save`` is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rl_plugin.arguments._util import fail
from rl_plugin.arguments.model_layout import check_model_layout
from rl_plugin.checkpoint.layout import PARTIAL, STEP_DIR, TRACKER, latest_step
from rl_plugin.configs.checkpointing import same_dir
from rl_plugin.user_code import check_source


def _file(flag: str, value: Optional[str]) -> None:
    if value is not None and not Path(value).is_file():
        what = "is a directory" if Path(value).is_dir() else "does not exist"
        fail(f"{flag} {value}", f"the file {what}", "pass the path of a JSONL file (one JSON object per line)")


# the weight formats ``from_pretrained`` reads: model.safetensors, sharded model-0000x-of-0000y.safetensors, pytorch_model*.bin
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def _hf_checkpoint(value: Optional[str]) -> None:
    if value is None:
        return
    if not Path(value).is_dir():
        fail(
            f"--hf-checkpoint {value}",
            "the directory does not exist",
            "pass a Hugging Face model directory (config.json + weights)",
        )
    if not (Path(value) / "config.json").is_file():
        fail(
            f"--hf-checkpoint {value}",
            "the directory holds no config.json",
            "point it at a Hugging Face model directory",
        )
    if not any(next(Path(value).glob(p), None) is not None for p in WEIGHT_PATTERNS):
        # only the config and tokenizer (an interrupted download, --include '*.json'): it would fail
        # minutes later inside an actor with a transformers/mbridge traceback
        present = sorted(p.name for p in Path(value).iterdir())[:8]
        fail(
            f"--hf-checkpoint {value}",
            f"no weight files there ({' or '.join(WEIGHT_PATTERNS)}); it holds {present}",
            "download the complete model (e.g. `huggingface-cli download REPO --local-dir DIR` fetches the weights too) "
            "or point the flag at the directory that has them",
        )


def _load(args) -> None:
    load = args.load
    if load is None:
        return
    path = Path(load)
    if not path.exists():
        fail(
            f"--load {load}",
            "the directory does not exist (only an existing, empty directory means 'no checkpoint yet, start fresh')",
            f"check the path for a typo; to start a new run that will save there, create it first (mkdir -p {load})",
        )
    if not path.is_dir():
        fail(
            f"--load {load}", "is a file, not a checkpoint directory", "pass the --save directory of the run to resume"
        )
    if path.name.endswith(PARTIAL):
        fail(
            f"--load {load}",
            "this is an unfinished save (the run was killed while writing it); it is never a resume point",
            f"pass --load {path.parent} (its {TRACKER} names the last complete step)",
        )
    if STEP_DIR.match(path.name) and latest_step(path) is None:
        fail(
            f"--load {load}",
            "this is one checkpoint step inside a --save directory; --load takes the --save directory "
            f"itself (its {TRACKER} names the step to resume)",
            f"pass --load {path.parent}",
        )
    latest_step(path)  # a corrupt tracker is named here


def _save(args) -> None:
    save = args.save
    if save is None or args.overwrite_save or same_dir(save, args.load):
        return
    step = latest_step(save)
    if step is None:
        return
    resumed = f"resumes from --load {args.load}" if args.load else "does not resume from them (no --load)"
    fail(
        f"--save {save}",
        f"the directory already holds a run's checkpoints up to step {step} ({Path(save) / TRACKER}) and this run "
        f"{resumed}; it would overwrite their iter_* directories and move the resume point back to its own steps",
        f"resume that run with --load {save}, or pass --overwrite-save to start over (its checkpoints are moved aside "
        f"into {Path(save) / 'overwritten_<N>'}/, not deleted), or choose another --save directory",
    )


def validate_paths(args) -> None:
    _file("--prompt-data", args.prompt_data)
    _file("--eval-prompt-data", args.eval_prompt_data)
    _hf_checkpoint(args.hf_checkpoint)
    check_model_layout(args)
    check_source(args.custom_rm_path, "--custom-rm-path")
    check_source(args.custom_generate_function_path, "--custom-generate-function-path")
    check_source(args.rollout_function_path, "--rollout-function-path")
    _load(args)
    _save(args)
