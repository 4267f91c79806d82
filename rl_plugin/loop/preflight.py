"""What ``rl-plugin-train`` checks in its first second, before Ray or a model starts.

Everything that needs no world, so a bad command line or a bad file costs a second, not the
~15 s of cluster and model start-up (and never half a run):

0. first, on the flags as given (``rl_plugin.arguments.setup.check_command_line``, called by the
   run before it builds its config): a model and data that go together, the data-parallel rules
   for the DP size the cluster flags imply, the files the flags name (data, model, reward module,
   ``--load`` exists, ``--save`` holds no other run's checkpoints);
1. then ``preflight(run)`` on the typed ``RunConfig``: (2) the model's family is one the backend
   trains (``rl_plugin.backends.model_families``), the output directories are writable;
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

from rl_plugin.arguments.file_contents import ResumePoint, check_file_contents, run_tokenizer
from rl_plugin.checkpoint.layout import read_loop_state
from rl_plugin.checkpoint.run_settings import resume_note
from rl_plugin.configs.run import RunConfig
from rl_plugin.errors import RLArgumentError, fail
from rl_plugin.flags import flag_of
from rl_plugin.loop.disk_checks import check_output_dirs
from rl_plugin.loop.model_check import check_model_family


def is_finished(run: RunConfig, next_rollout: Optional[int]) -> bool:
    return next_rollout is not None and next_rollout == run.rollout.num_rollout


def finished_message(run: RunConfig, step: int) -> str:
    n = run.rollout.num_rollout
    return (
        f"--load {run.checkpoint.load}: the run is complete: its checkpoint (step {step}) has done all {n} rollouts of "
        f"--num-rollout {n}, so there is nothing to train. To train further, raise --num-rollout "
        f"(it counts all rollouts of the run, e.g. --num-rollout {2 * n})"
    )


def check_reward_and_data(run: RunConfig) -> None:
    from rl_plugin.rollout.data.prompt_check import check_prompt_file, model_context_length, model_vocab_size
    from rl_plugin.rollout.rewards.functions import RewardFunctionError
    from rl_plugin.rollout.rewards.scorer import SampleScorer

    cfg, hf_checkpoint = run.rollout, run.train.model.hf_checkpoint
    try:
        SampleScorer(cfg)  # loads the function and checks its form against --group-rm
    except RewardFunctionError as exc:  # already names the flag, the file:line and the fix
        raise RLArgumentError(str(exc)) from None
    except ValueError as exc:
        fail(
            f"--custom-rm-path {cfg.custom_rm_path}",
            str(exc),
            "pass package.module:function or path/to/file.py:function",
        )
    if cfg.rm_url is not None:  # remote_rm, or a --custom-rm-path rm that calls remote_rm(args, sample)
        check_reward_server(cfg.rm_url)
    tokenizer = run_tokenizer(run)
    if run.custom_generation.custom_agent_function_path and hasattr(tokenizer, "tok"):
        from rl_plugin.rollout.agent.template import AgentPrompts

        tokenizer = AgentPrompts(tokenizer)  # chat messages go through the template, flag or not
    context = model_context_length(hf_checkpoint)
    vocab = model_vocab_size(hf_checkpoint)
    for flag, path in (("--prompt-data", cfg.prompt_data), ("--eval-prompt-data", cfg.eval_prompt_data)):
        if path is not None and cfg.multimodal.image_key is None:  # with images: file_contents.check_image_data
            check_prompt_file(
                flag,
                path,
                tokenizer,
                input_key=cfg.input_key,
                label_key=cfg.label_key,
                metadata_key=cfg.metadata_key,
                max_response_len=cfg.rollout_max_response_len,
                context_len=context,
                hf_checkpoint=hf_checkpoint,
                rm_type=cfg.rm_type,
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


def note_changed_settings(run: RunConfig, point: Optional[ResumePoint]) -> None:
    """A resume with another batch size, aggregation or data file than the checkpoint's: one note
    on stderr naming each change (``rl_plugin.checkpoint.run_settings``)."""
    if point is None:
        return
    load = run.checkpoint.load
    state = read_loop_state(load, point.step) or {}
    note = resume_note(load, point.step, state.get("settings"), run)
    if note is not None:
        print(note, file=sys.stderr, flush=True)


# The user functions loaded here: (the config in the run config, its field naming the function).
# The other ``*-path`` flags load where they are checked: --dynamic-sampling-filter-path and
# --custom-tis-function-path in their configs' rules (at parse time), --custom-rm-path with the
# reward's form (``check_reward_and_data``).
USER_FUNCTIONS = (
    ("custom_generation", "custom_generate_function_path"),
    ("custom_generation", "rollout_function_path"),
    ("custom_generation", "custom_agent_function_path"),
    ("train.loss", "custom_pg_loss_reducer_function_path"),
)


def check_user_functions(run: RunConfig) -> None:
    """Import every function of ``USER_FUNCTIONS`` now (``user_code.check_importable``), so a
    missing file or name costs a second here, not a Ray start-up and a remote traceback."""
    from rl_plugin.user_code import check_importable

    for path, name in USER_FUNCTIONS:
        config = run
        for part in path.split("."):
            config = getattr(config, part)
        spec = getattr(config, name)
        if spec:
            check_importable(spec, flag_of(type(config), name).names[0])


def preflight(run: RunConfig) -> Optional[ResumePoint]:
    """Raise ``RLArgumentError`` (exit 2) on the first problem; returns the resume point. ``run``
    is built from flags that passed ``check_command_line`` (``rl_plugin.arguments.setup``)."""
    check_user_functions(run)
    check_model_family(run.train.model.hf_checkpoint, run.train.train_backend)  # the backend builds its type
    check_output_dirs(run)
    if run.mode.generates:  # SFT has no reward; its data: check_file_contents
        check_reward_and_data(run)
    point = check_file_contents(run)  # the resume checkpoint, the data, the OPD teacher: as the flag checker
    note_changed_settings(run, point)
    return point
