"""Mixture-of-experts routing replay (slime's spelling): the one mode a run trains with, and its rules.

- ``--use-rollout-routing-replay`` (R3, Ma et al. 2025, arXiv:2510.11370): the engine records the
  experts it routed every token to; every forward of the trainer on that rollout (old and
  reference log-probs, the training pass) uses exactly those experts.
- ``--use-routing-replay`` (R2, the GSPO report's routing replay, arXiv:2507.18071): the
  trainer's old-log-prob pass records its own routing and the training passes replay it.

Both together mean what they mean in slime: R3 (slime turns R2's machinery on under R3; the
rollout's routing is what every pass replays). ``routing_replay_mode`` gives the one mode the
trainer runs: ``"rollout"``, ``"old"`` or None.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from rl_plugin.errors import fail
from rl_plugin.flags import derived, option
from rl_plugin.models.experts import checkpoint_num_experts
from rl_plugin.routing.engines import ENGINE_REFUSALS, flags_of
from rl_plugin.routing.mode import routing_replay_mode

GROUP = "routing replay"


@dataclass(frozen=True)
class RoutingReplaySettings:
    routing_replay: Optional[str] = derived(  # "rollout" (R3) | "old" (R2) | None
        routing_replay_mode,
        None,
        inputs=[
            option(
                "--use-rollout-routing-replay",
                action="store_true",
                help=(
                    "R3 (Ma et al. 2025, 'Stabilizing MoE RL by aligning training and inference routers', arXiv:2510.11370; "
                    "slime --use-rollout-routing-replay): the engine records the experts each token was routed to, and every "
                    "trainer forward on the rollout (old and reference log-probs, the training pass) uses exactly those "
                    "experts, so routing no longer adds to the train-inference mismatch. Use with MoE models whose runs "
                    "collapse from routing drift. Needs an MoE --hf-checkpoint and an engine that records (hf)."
                ),
                group=GROUP,
            ),
            option(
                "--use-routing-replay",
                action="store_true",
                help=(
                    "R2 (routing replay of the GSPO report, arXiv:2507.18071; slime --use-routing-replay): the old-log-prob "
                    "pass records the trainer's routing and the training passes replay it, so later optimizer steps on the "
                    "same rollout keep the old policy's experts. With --use-rollout-routing-replay it means R3, as in slime."
                ),
                group=GROUP,
            ),
        ],
    )

    def check(self, run) -> None:
        mode = self.routing_replay
        if mode is None:
            return
        flag = "--use-rollout-routing-replay" if mode == "rollout" else "--use-routing-replay"
        if mode == "rollout" and run.rollout.engine.engine in ENGINE_REFUSALS:
            fail(flags_of(run.rollout.engine.engine), *ENGINE_REFUSALS[run.rollout.engine.engine])
        hook = "--custom-generate-function-path" if run.custom_generation.custom_generate_function_path else None
        hook = hook or ("--rollout-function-path" if run.custom_generation.rollout_function_path else None)
        if mode == "rollout" and hook:
            fail(
                f"--use-rollout-routing-replay with {hook}",
                "generate_tokens does not return the engine's routed experts yet, so a hook's samples carry none to replay",
                f"drop one, or use --use-routing-replay (R2: the trainer's own old-pass routing) with {hook}",
            )
        if not self.model.hf_checkpoint:
            fail(
                flag,
                "routing replay needs a mixture-of-experts model; the embedded default model is dense",
                "pass an MoE --hf-checkpoint",
            )
        if os.path.exists(os.path.join(str(self.model.hf_checkpoint), "config.json")) and not checkpoint_num_experts(
            self.model.hf_checkpoint
        ):
            fail(
                f"{flag} with --hf-checkpoint {self.model.hf_checkpoint}",
                "it is a dense model (its config.json names no num_experts / num_local_experts / n_routed_experts)",
                "pass a mixture-of-experts --hf-checkpoint, or drop the flag",
            )
        if mode == "old" and self.use_rollout_logprobs:
            fail(
                "--use-routing-replay with --use-rollout-logprobs",
                "R2 records the routing of the trainer's old-log-prob pass, which --use-rollout-logprobs skips "
                "(the engine's log-probs are the old ones)",
                "drop one, or use --use-rollout-routing-replay (R3: the engine's routing)",
            )
