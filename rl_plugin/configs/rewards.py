"""RewardConfig: how a sample is scored: a built-in verifier (``--rm-type``), your function
(``--custom-rm-path``, per sample or per group) or a remote reward model (``--rm-url`` and its
client). slime's spellings. The scorer is ``rl_plugin.rollout.rewards.scorer``, the HTTP client
``rl_plugin.rollout.rewards.remote_rm``; ``RolloutConfig`` carries these fields under the same names."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from rl_plugin.configs._checks import is_positive_finite
from rl_plugin.errors import fail
from rl_plugin.flags import Declared, flag
from rl_plugin.registries import REMOTE_RM_DEFAULTS, REWARDS
from rl_plugin.urls import url_host_port

DEFAULT_MAX_CONCURRENCY, DEFAULT_TIMEOUT_S, DEFAULT_MAX_RETRIES = REMOTE_RM_DEFAULTS.values()
# --rm-timeout of a local --custom-rm-path function, per call (per group with --group-rm), when the
# flag is unset: longer than the remote client's per-attempt 60 s, because a local call is not
# retried and its own waits (a semaphore over all samples, a judge's queue) count; finite, so a
# function that never returns stops the run naming the sample instead of freezing it.
DEFAULT_LOCAL_TIMEOUT_S = 600.0

# the remote client's flags (an unset flag is None: the client takes REMOTE_RM_DEFAULTS); --rm-timeout
# is also the deadline of a local --custom-rm-path function
REMOTE_FLAGS = (
    ("--rm-max-concurrency", "rm_max_concurrency"),
    ("--rm-max-retries", "rm_max_retries"),
)

# slime's --rm-type values (slime/rollout/rm_hub/__init__.py: async_rm) -> ours. Only `math`
# checks what one of our built-ins checks; the others are refused by ``parse_rm_type`` below.
SLIME_RM_TYPES = {"math": "math_exact"}
SLIME_ONLY_RM_TYPES = ("deepscaler", "dapo", "f1", "gpqa", "ifbench", "random")


def parse_rm_type(value: str) -> str:
    """argparse ``type`` of ``--rm-type``: slime's spelling of a built-in becomes ours; a slime
    verifier rl_plugin does not ship fails naming how to bring it. Anything else is left to
    argparse's ``choices``."""
    if value in SLIME_RM_TYPES:
        return SLIME_RM_TYPES[value]
    if value in SLIME_ONLY_RM_TYPES or value.startswith("boxed_"):
        raise argparse.ArgumentTypeError(
            f"{value!r} is one of slime's verifiers and has no rl_plugin built-in (built-ins: {', '.join(REWARDS.names())}; "
            f"slime's 'math' is accepted as math_exact). Fix: write it as fn(prompt, response, label) -> float or slime's "
            "`async def rm(args, sample)` and pass --custom-rm-path package.module:function (or file.py:function) instead of --rm-type"
        )
    return value


def url_problem(url: str):
    """Why ``url`` is no http(s) URL with a host, or None."""
    try:
        url_host_port(url)
    except ValueError as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class RewardConfig(Declared):
    rm_type: Optional[str] = flag(
        "--rm-type",
        type=parse_rm_type,
        choices=REWARDS.names,
        default=None,
        group="rewards",
        help="Built-in verifier: digit_match (the embedded task's partial credit: matching positions / label length) or math_exact (final answer, \\boxed{} or last number, equals the label). Default: digit_match for the embedded task. slime's --rm-type math is accepted as math_exact (the same check of the final \\boxed{} answer against the label, by normalised string equality where slime also tries sympy equivalence); remote_rm (slime's): each sample is scored by the HTTP server at --rm-url (see the rewards flags). slime's other verifiers (deepscaler, dapo, f1, gpqa, ifbench, random, boxed_*) are refused with how to port them as --custom-rm-path.",
    )
    custom_rm_path: Optional[str] = flag(
        "--custom-rm-path",
        type=str,
        default=None,
        group="rewards",
        help="Your reward function, 'package.module:function' or 'file.py:function', in one of two forms told apart by its required positional parameters: fn(prompt, response, label) -> float (with a `metadata` keyword it also gets --metadata-key's object), or slime's `async def rm(args, sample)` returning a number or a dict (--reward-key), all samples scored concurrently; with --group-rm, `async def rm(args, samples) -> list[float]` per group. Replaces --rm-type.",
    )
    group_rm: bool = flag(
        "--group-rm",
        action="store_true",
        group="rewards",
        help="Score a whole group at once (slime's flag): --custom-rm-path's function is called as `async def rm(args, samples) -> list[float]` once per prompt's group of --n-samples-per-prompt samples (all groups concurrently) and returns one reward per sample, in order. Needs --custom-rm-path with that signature.",
    )
    reward_key: Optional[str] = flag(
        "--reward-key",
        type=str,
        default=None,
        group="rewards",
        help="When a reward is a dict (an `rm(args, sample)` function's or the remote server's answer), the key of the number trained on (slime's flag); the dict is kept as the sample's reward. Default: 'reward'.",
    )
    rm_url: Optional[str] = flag(
        "--rm-url",
        type=str,
        default=None,
        group="rewards",
        help='The reward server of --rm-type remote_rm (slime\'s flag): every sample is POSTed as JSON {"prompt", "response", "label", "metadata"}; the answer is a number or {"reward": x}. With --custom-rm-path, your rm reads it as args.rm_url and may await slime\'s remote_rm(args, sample) (rl_plugin.rollout.rewards.remote_rm), which shares one client per process (--rm-max-concurrency, --rm-max-retries hold over all its calls). A server that is down fails the run at start-up, naming the URL.',
    )
    rm_max_concurrency: Optional[int] = flag(
        "--rm-max-concurrency",
        type=int,
        default=None,
        group="rewards",
        help=f"Most requests to --rm-url in flight at once. Default: {DEFAULT_MAX_CONCURRENCY}.",
    )
    rm_timeout: Optional[float] = flag(
        "--rm-timeout",
        type=float,
        default=None,
        group="rewards",
        help=(
            f"Seconds one request to --rm-url may take before it counts as failed (and is retried; default "
            f"{DEFAULT_TIMEOUT_S:g}), or one call of --custom-rm-path's function (per sample, per group with --group-rm; "
            f"not retried: the rollout stops naming the function, its file:line and the sample; default "
            f"{DEFAULT_LOCAL_TIMEOUT_S:g}). A plain `def` function runs in a worker thread that a deadline cannot "
            "interrupt: it is left behind."
        ),
    )
    rm_max_retries: Optional[int] = flag(
        "--rm-max-retries",
        type=int,
        default=None,
        group="rewards",
        help=f"Retries of a request to --rm-url after a connection error, a timeout or HTTP 408/429/5xx, with exponential backoff (0.5 s, 1 s, 2 s, ...); then the run stops naming the URL, the error and the sample. Default: {DEFAULT_MAX_RETRIES}.",
    )

    def check(self, run) -> None:
        if self.custom_rm_path and self.rm_type:
            fail(
                "--custom-rm-path with --rm-type",
                "the custom reward function replaces the built-in one, so one of them would be silently ignored",
                "drop one of the two flags",
            )
        self._check_remote(run)
        if self.group_rm and not self.custom_rm_path:
            fail(
                "--group-rm without --custom-rm-path",
                "--group-rm calls your `async def rm(args, samples) -> list[float]` once per group; the built-in rewards (and "
                "remote_rm) score one sample per call",
                "pass --custom-rm-path file.py:rm with that signature, or drop --group-rm",
            )

    def _check_remote(self, run) -> None:
        remote = self.rm_type == "remote_rm"  # --custom-rm-path with --rm-type is refused above
        # the client is on for remote_rm, and for a --custom-rm-path rm that calls slime's
        # remote_rm(args, sample) itself (it reads args.rm_url, as in slime)
        client = remote or (self.custom_rm_path is not None and self.rm_url is not None)
        if remote and self.rm_url is None:
            fail(
                "--rm-type remote_rm without --rm-url",
                "the remote reward model needs the address of its server",
                'pass --rm-url http://HOST:PORT/PATH (the server answers POST {prompt, response, label, metadata} with a number or {"reward": x})',
            )
        if self.rm_url is not None and not client:
            fail(
                "--rm-url without --rm-type remote_rm or --custom-rm-path",
                "only the remote reward model (or your reward function, through remote_rm(args, sample)) reads --rm-url, "
                "so it would be silently ignored",
                "add --rm-type remote_rm (or --custom-rm-path with an rm that calls remote_rm), or drop --rm-url",
            )
        if self.rm_url is not None:
            why = url_problem(self.rm_url)
            if why is not None:
                fail(f"--rm-url {self.rm_url}", why, "pass e.g. --rm-url http://127.0.0.1:8000/reward")
        if self.rm_timeout is not None and not remote and not self.custom_rm_path:
            fail(
                "--rm-timeout without --rm-type remote_rm or --custom-rm-path",
                "it bounds a request to the reward server or a call of your reward function; the built-in verifiers "
                "have none, so it would be silently ignored",
                "add --rm-type remote_rm --rm-url URL or --custom-rm-path, or drop it",
            )
        given = [flag for flag, attr in REMOTE_FLAGS if getattr(self, attr) is not None]
        if given and not client:
            fail(
                f"{', '.join(given)} without --rm-url",
                "they set the remote reward model's client (--rm-type remote_rm, or remote_rm(args, sample) called by "
                "--custom-rm-path's function), which is off, so they would be silently ignored",
                "add --rm-type remote_rm --rm-url URL (or --rm-url with --custom-rm-path), or drop them",
            )
        if self.rm_max_concurrency is not None and self.rm_max_concurrency < 1:
            fail(
                "--rm-max-concurrency",
                f"must be >= 1 (got {self.rm_max_concurrency})",
                "use e.g. --rm-max-concurrency 32",
            )
        if self.rm_timeout is not None and not is_positive_finite(self.rm_timeout):
            fail(
                "--rm-timeout",
                f"must be a positive number of seconds (got {self.rm_timeout})",
                "use e.g. --rm-timeout 60",
            )
        if self.rm_max_retries is not None and self.rm_max_retries < 0:
            fail(
                "--rm-max-retries",
                f"must be >= 0 (got {self.rm_max_retries})",
                "use 0 (no retry) or e.g. --rm-max-retries 3",
            )
