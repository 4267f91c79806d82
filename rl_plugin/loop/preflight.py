"""What ``rl-plugin-train`` checks in its first second, before Ray or a model starts.

Everything that needs no world, so a bad command line or a bad file costs a second, not the
~15 s of cluster and model start-up (and never half a run):

0. a model and data that go together (``check_setup``): no ``--hf-checkpoint`` without
   ``--prompt-data`` (unless of the embedded family), no data without a model
   (``rl_plugin.arguments.embedded.check_model_and_data``; the parse checks it too, this is for
   runs built from a ``Namespace``);
1. the data-parallel rules for the DP size the cluster flags imply (``validate_world``);
2. the files the flags name (``rl_plugin.arguments.paths``: data, model, reward module, ``--load``
   exists, ``--save`` holds no other run's checkpoints), and the model's family is one the
   backend trains (``rl_plugin.backends.model_families``);
3. what the files hold (``rl_plugin.arguments.file_contents.check_file_contents``, the flag
   checker's check too): the checkpoint to resume (written by this ``--train-backend``, not
   already at or past ``--num-rollout``, its LoRA adapters' shape and base), every SFT
   conversation (it templates and fits the model's context), the ``--use-opd`` teacher; a note
   names the settings that changed since the checkpoint was written (``note_changed_settings``);
4. every user function a ``*-path`` flag names loads (``check_user_functions``: the generate hook,
   the rollout function, the loss reducer; the dynamic-sampling filter and the TIS function load
   in their flags' checks, the reward function below): a typo is named with the functions the
   file does define, before Ray starts;
5. the reward function imports (errors at the user's file:line) and its form suits ``--group-rm``;
   with ``--rm-url`` (``--rm-type remote_rm``, or a ``--custom-rm-path`` rm calling ``remote_rm``),
   the server there accepts connections;
6. every RL prompt of ``--prompt-data`` / ``--eval-prompt-data`` (JSONL or Parquet, a string or
   chat messages) tokenizes sanely (integer ids inside the model's vocabulary, not implausibly
   few for its text) and fits the model's context with ``--rollout-max-response-len``
   (``rl_plugin.rollout.data.prompt_check``); no chat ends in an assistant turn.

The output-directory lock (``run_lock``) and ``--overwrite-save`` (moving the old checkpoints
aside) are the driver's, taken right after these checks.
"""

from __future__ import annotations

import sys
from typing import Optional

from rl_plugin.arguments import validate_world
from rl_plugin.arguments.embedded import check_model_and_data
from rl_plugin.arguments.file_contents import (  # noqa: F401 - check_progress, check_resume_point: the run's
    ResumePoint,
    check_file_contents,
    check_progress,
    check_resume_point,
)
from rl_plugin.arguments.paths import validate_paths
from rl_plugin.arguments.unread_flags import check_layout_flags
from rl_plugin.checkpoint.layout import read_loop_state
from rl_plugin.checkpoint.run_settings import resume_note
from rl_plugin.configs.cluster import planned_dp_size
from rl_plugin.errors import RLArgumentError, fail
from rl_plugin.loop.disk_checks import check_output_dirs
from rl_plugin.loop.model_check import check_model_family


def is_finished(args, next_rollout: Optional[int]) -> bool:
    return next_rollout is not None and next_rollout == args.num_rollout


def finished_message(args, step: int) -> str:
    return (
        f"--load {args.load}: the run is complete: its checkpoint (step {step}) has done all {args.num_rollout} rollouts of "
        f"--num-rollout {args.num_rollout}, so there is nothing to train. To train further, raise --num-rollout "
        f"(it counts all rollouts of the run, e.g. --num-rollout {2 * args.num_rollout})"
    )


def check_reward_and_data(args) -> None:
    from rl_plugin.rollout.data.prompt_check import check_prompt_file, model_context_length, model_vocab_size
    from rl_plugin.rollout.data.tokenizer import load_tokenizer
    from rl_plugin.rollout.rewards.functions import RewardFunctionError
    from rl_plugin.rollout.rewards.scorer import SampleScorer

    try:
        SampleScorer(args)  # loads the function and checks its form against --group-rm
    except RewardFunctionError as exc:  # already names the flag, the file:line and the fix
        raise RLArgumentError(str(exc)) from None
    except ValueError as exc:
        fail(
            f"--custom-rm-path {args.custom_rm_path}",
            str(exc),
            "pass package.module:function or path/to/file.py:function",
        )
    if args.rm_url is not None:  # remote_rm, or a --custom-rm-path rm that calls remote_rm(args, sample)
        check_reward_server(args.rm_url)
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
    vocab = model_vocab_size(args.hf_checkpoint)
    for flag, path in (("--prompt-data", args.prompt_data), ("--eval-prompt-data", args.eval_prompt_data)):
        if path is not None:
            check_prompt_file(
                flag,
                path,
                tokenizer,
                input_key=args.input_key,
                label_key=args.label_key,
                metadata_key=args.metadata_key,
                max_response_len=args.rollout_max_response_len,
                context_len=context,
                hf_checkpoint=args.hf_checkpoint,
                rm_type=args.rm_type,
                vocab_size=vocab,
            )


def check_reward_server(url: str) -> None:
    """``--rm-url``: something accepts connections there (a TCP connect, a few
    seconds at most), so a server that is down is named before Ray starts."""
    from rl_plugin.rollout.rewards.remote_rm import PROBE_TIMEOUT_S, probe

    why = probe(url)
    if why is not None:
        fail(
            f"--rm-url {url}",
            f"the reward server is not reachable ({why}; probed for {PROBE_TIMEOUT_S:g} s before starting Ray)",
            "start the reward server first, or correct the host and port of --rm-url",
        )


def check_setup(args) -> None:
    """The setup checks that need no world: model and data go together; flags the sequence layout
    does not read are warned (``arguments.unread_flags``; the model's flags: ``validate_paths``)."""
    check_model_and_data(args)
    check_layout_flags(args)


def note_changed_settings(args, point: Optional[ResumePoint]) -> None:
    """A resume with another batch size, aggregation or data file than the checkpoint's: one note
    on stderr naming each change (``rl_plugin.checkpoint.run_settings``)."""
    if point is None:
        return
    state = read_loop_state(args.load, point.step) or {}
    note = resume_note(args.load, point.step, state.get("settings"), args)
    if note is not None:
        print(note, file=sys.stderr, flush=True)


# the user-function flags loaded here: (flag, attribute). The other ``*-path`` flags load where
# they are checked: --dynamic-sampling-filter-path and --custom-tis-function-path in their configs'
# rules (at parse time), --custom-rm-path with the reward's form (``check_reward_and_data``).
USER_FUNCTION_FLAGS = (
    ("--custom-generate-function-path", "custom_generate_function_path"),
    ("--rollout-function-path", "rollout_function_path"),
    ("--custom-agent-function-path", "custom_agent_function_path"),
    ("--custom-pg-loss-reducer-function-path", "custom_pg_loss_reducer_function_path"),
)


def check_user_functions(args) -> None:
    """Import every function of ``USER_FUNCTION_FLAGS`` now (``user_code.check_importable``), so a
    missing file or name costs a second here, not a Ray start-up and a remote traceback."""
    from rl_plugin.user_code import check_importable

    for flag, attr in USER_FUNCTION_FLAGS:
        spec = getattr(args, attr, None)
        if spec:
            check_importable(spec, flag)


def preflight(args) -> Optional[ResumePoint]:
    """Raise ``RLArgumentError`` (exit 2) on the first problem; returns the resume point."""
    check_setup(args)
    validate_world(args, dp_size=planned_dp_size(args))
    validate_paths(args)
    check_user_functions(args)
    check_model_family(args)  # the --train-backend builds this --hf-checkpoint's model type
    check_output_dirs(args)
    if args.loss_type != "sft_loss":  # SFT has no reward; its data: check_file_contents
        check_reward_and_data(args)
    point = check_file_contents(args)  # the resume checkpoint, the data, the OPD teacher: as the flag checker
    note_changed_settings(args, point)
    return point
