"""DynamicSamplingConfig: DAPO's rollout control (Yu et al. 2025), dynamic sampling (over-sample,
keep the groups a filter passes) and the soft over-long reward shaping
(``rl_plugin.rollout.dapo.dynamic_sampling`` / ``filters``). slime's names where slime has the flag.
``RolloutConfig`` carries these fields under the same names."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from rl_plugin.errors import fail
from rl_plugin.flags import Declared, flag
from rl_plugin.registries import BUILTIN_FILTER, DYNAMIC_SAMPLING_MAX_ROUNDS
from rl_plugin.user_code import check_importable

GROUP = "dynamic sampling"


@dataclass(frozen=True)
class DynamicSamplingConfig(Declared):
    over_sampling_batch_size: Optional[int] = flag(
        "--over-sampling-batch-size",
        type=int,
        default=None,
        group=GROUP,
        help="Dynamic sampling (DAPO, Yu et al. 2025): prompts sampled per round; rounds repeat until --rollout-batch-size groups pass --dynamic-sampling-filter-path, and only those are trained on. Default: --rollout-batch-size. Needs the filter.",
    )
    dynamic_sampling_filter_path: Optional[str] = flag(
        "--dynamic-sampling-filter-path",
        type=str,
        default=None,
        group=GROUP,
        help=f"Group filter of dynamic sampling, 'package.module:function' or 'file.py:function' (the forms of --custom-rm-path), slime's signature fn(args, samples, **kw) -> bool (or an object with .keep), deciding on the raw rewards before any shaping. It must return a bool (numpy.bool_ is accepted; None, strings, ints and tensors stop the run at the first group, naming the filter). Built-in: {BUILTIN_FILTER} (keep groups whose rewards are not all equal; DAPO's filter).",
    )
    dynamic_sampling_max_rounds: int = flag(
        "--dynamic-sampling-max-rounds",
        type=int,
        default=DYNAMIC_SAMPLING_MAX_ROUNDS,
        group=GROUP,
        help="Dynamic sampling: rounds of --over-sampling-batch-size prompts a rollout may generate to fill --rollout-batch-size passing groups before the run stops, naming the counts (each round after the first prints a progress line). Lower it to fail fast on a filter that rejects nearly everything; raise it for a task where few groups pass.",
    )
    overlong_buffer_len: Optional[int] = flag(
        "--overlong-buffer-len",
        type=int,
        default=None,
        group=GROUP,
        help="DAPO's soft over-long punishment (Yu et al. 2025, sec. 3.4): a response longer than --rollout-max-response-len minus this buffer loses reward linearly, reaching -(--overlong-penalty-factor) at the maximum length. Applied after the dynamic-sampling filter. DAPO uses a 4096-token buffer at 20480.",
    )
    overlong_penalty_factor: Optional[float] = flag(  # None: 1.0 with --overlong-buffer-len (RolloutConfig)
        "--overlong-penalty-factor",
        type=float,
        default=None,
        group=GROUP,
        help="Maximum over-long penalty (default 1.0 with --overlong-buffer-len, as in DAPO).",
    )

    def check(self, run) -> None:
        osb, path = self.over_sampling_batch_size, self.dynamic_sampling_filter_path
        if osb is not None and path is None:
            fail(
                "--over-sampling-batch-size without --dynamic-sampling-filter-path",
                "over-sampling without a filter samples prompts that are then thrown away unfiltered",
                f"add --dynamic-sampling-filter-path {BUILTIN_FILTER}, or drop --over-sampling-batch-size",
            )
        rounds = self.dynamic_sampling_max_rounds
        if rounds != DYNAMIC_SAMPLING_MAX_ROUNDS and path is None:
            fail(
                "--dynamic-sampling-max-rounds without --dynamic-sampling-filter-path",
                "without a filter a rollout is one round, so the cap would be silently ignored",
                f"add --dynamic-sampling-filter-path {BUILTIN_FILTER}, or drop --dynamic-sampling-max-rounds",
            )
        if rounds < 1:
            fail(
                "--dynamic-sampling-max-rounds",
                f"must be >= 1 (got {rounds})",
                f"use a round count >= 1 (default {DYNAMIC_SAMPLING_MAX_ROUNDS})",
            )
        if osb is not None and osb < 1:
            fail(
                "--over-sampling-batch-size", f"must be >= 1 (got {osb})", "use a prompt count >= --rollout-batch-size"
            )
        rbs = run.train.batching.rollout_batch_size
        if osb is not None and rbs is not None and osb < rbs:
            fail(
                f"--over-sampling-batch-size {osb} with --rollout-batch-size {rbs}",
                "a round samples fewer prompts than a rollout trains on, so even a round where every group passes cannot fill the batch",
                f"use --over-sampling-batch-size >= {rbs} (DAPO over-samples, e.g. {2 * rbs})",
            )
        if path is not None:
            check_importable(path, "--dynamic-sampling-filter-path")
        self._check_overlong(run)

    def _check_overlong(self, run) -> None:
        buf, factor = self.overlong_buffer_len, self.overlong_penalty_factor
        if factor is not None and buf is None:
            fail(
                "--overlong-penalty-factor without --overlong-buffer-len",
                "the penalty needs the buffer where it ramps up, so it would be silently ignored",
                "add --overlong-buffer-len N (DAPO: 4096)",
            )
        if factor is not None and not (math.isfinite(factor) and factor >= 0):
            fail("--overlong-penalty-factor", f"must be a finite number >= 0 (got {factor})", "use e.g. 1.0")
        if buf is None:
            return
        if buf < 1:
            fail(
                "--overlong-buffer-len",
                f"must be >= 1 (got {buf})",
                "use a positive token count, e.g. a quarter of --rollout-max-response-len",
            )
        max_len = run.rollout.engine.max_response_len
        if max_len is not None and buf >= max_len:
            fail(
                f"--overlong-buffer-len {buf} with --rollout-max-response-len {max_len}",
                "the buffer must leave a penalty-free length L_max - buffer > 0, or every response is punished",
                f"use --overlong-buffer-len < {max_len}",
            )
