"""Flags of the sample-level and remote rewards (slime's spellings): ``--group-rm``,
``--reward-key`` and the remote reward model's ``--rm-url`` and its client settings.
``--rm-type`` and ``--custom-rm-path`` are in ``rollout``; the scorer is
``rl_plugin.rollout.rewards.scorer``, the HTTP client ``rl_plugin.rollout.rewards.remote_rm``."""

from __future__ import annotations

from rl_plugin.arguments._util import add_flag, fail, is_positive_finite
from rl_plugin.registries import REMOTE_RM_DEFAULTS
from rl_plugin.urls import url_host_port

DEFAULT_MAX_CONCURRENCY, DEFAULT_TIMEOUT_S, DEFAULT_MAX_RETRIES = REMOTE_RM_DEFAULTS.values()

# the remote client's flags (an unset flag is None: the client takes REMOTE_RM_DEFAULTS)
REMOTE_FLAGS = (
    ("--rm-max-concurrency", "rm_max_concurrency"),
    ("--rm-timeout", "rm_timeout"),
    ("--rm-max-retries", "rm_max_retries"),
)


def url_problem(url: str):
    """Why ``url`` is no http(s) URL with a host, or None."""
    try:
        url_host_port(url)
    except ValueError as exc:
        return str(exc)
    return None


def add_arguments(parser):
    g = parser.add_argument_group(
        "rewards", "Sample-level, group and remote rewards (--rm-type and --custom-rm-path are under rollout)."
    )
    add_flag(
        g,
        "--group-rm",
        action="store_true",
        help="Score a whole group at once (slime's flag): --custom-rm-path's function is called as `async def rm(args, samples) -> list[float]` once per prompt's group of --n-samples-per-prompt samples (all groups concurrently) and returns one reward per sample, in order. Needs --custom-rm-path with that signature.",
    )
    add_flag(
        g,
        "--reward-key",
        type=str,
        default=None,
        help="When a reward is a dict (an `rm(args, sample)` function's or the remote server's answer), the key of the number trained on (slime's flag); the dict is kept as the sample's reward. Default: 'reward'.",
    )
    add_flag(
        g,
        "--rm-url",
        type=str,
        default=None,
        help='The reward server of --rm-type remote_rm (slime\'s flag): every sample is POSTed as JSON {"prompt", "response", "label", "metadata"}; the answer is a number or {"reward": x}. A server that is down fails the run at start-up, naming the URL.',
    )
    add_flag(
        g,
        "--rm-max-concurrency",
        type=int,
        default=None,
        help=f"Most requests to --rm-url in flight at once. Default: {DEFAULT_MAX_CONCURRENCY}.",
    )
    add_flag(
        g,
        "--rm-timeout",
        type=float,
        default=None,
        help=f"Seconds one request to --rm-url may take before it counts as failed (and is retried). Default: {DEFAULT_TIMEOUT_S:g}.",
    )
    add_flag(
        g,
        "--rm-max-retries",
        type=int,
        default=None,
        help=f"Retries of a request to --rm-url after a connection error, a timeout or HTTP 408/429/5xx, with exponential backoff (0.5 s, 1 s, 2 s, ...); then the run stops naming the URL, the error and the sample. Default: {DEFAULT_MAX_RETRIES}.",
    )
    return parser


def validate(args) -> None:
    remote = args.rm_type == "remote_rm"  # --custom-rm-path with --rm-type is refused by the rollout rules
    if args.rm_type == "remote_rm" and args.rm_url is None:
        fail(
            "--rm-type remote_rm without --rm-url",
            "the remote reward model needs the address of its server",
            'pass --rm-url http://HOST:PORT/PATH (the server answers POST {prompt, response, label, metadata} with a number or {"reward": x})',
        )
    if args.rm_url is not None and not remote:
        fail(
            "--rm-url without --rm-type remote_rm",
            "only the remote reward model reads --rm-url, so it would be silently ignored",
            "add --rm-type remote_rm, or drop --rm-url",
        )
    if args.rm_url is not None:
        why = url_problem(args.rm_url)
        if why is not None:
            fail(f"--rm-url {args.rm_url}", why, "pass e.g. --rm-url http://127.0.0.1:8000/reward")
    given = [flag for flag, attr in REMOTE_FLAGS if getattr(args, attr) is not None]
    if given and not remote:
        fail(
            f"{', '.join(given)} without --rm-type remote_rm",
            "they set the remote reward model's client, which is off, so they would be silently ignored",
            "add --rm-type remote_rm --rm-url URL, or drop them",
        )
    if args.rm_max_concurrency is not None and args.rm_max_concurrency < 1:
        fail(
            "--rm-max-concurrency", f"must be >= 1 (got {args.rm_max_concurrency})", "use e.g. --rm-max-concurrency 32"
        )
    if args.rm_timeout is not None and not is_positive_finite(args.rm_timeout):
        fail(
            "--rm-timeout", f"must be a positive number of seconds (got {args.rm_timeout})", "use e.g. --rm-timeout 60"
        )
    if args.rm_max_retries is not None and args.rm_max_retries < 0:
        fail(
            "--rm-max-retries",
            f"must be >= 0 (got {args.rm_max_retries})",
            "use 0 (no retry) or e.g. --rm-max-retries 3",
        )
    if args.group_rm and not args.custom_rm_path:
        fail(
            "--group-rm without --custom-rm-path",
            "--group-rm calls your `async def rm(args, samples) -> list[float]` once per group; the built-in rewards (and "
            "remote_rm) score one sample per call",
            "pass --custom-rm-path file.py:rm with that signature, or drop --group-rm",
        )
