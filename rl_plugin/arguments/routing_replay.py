"""Flags of mixture-of-experts routing replay (slime's spelling).

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

from rl_plugin.arguments._util import add_flag, fail
from rl_plugin.models.experts import checkpoint_num_experts
from rl_plugin.routing.engines import ENGINE_REFUSALS, flags_of
from rl_plugin.routing.mode import routing_replay_mode


def add_arguments(parser):
    g = parser.add_argument_group(
        "routing replay",
        "Mixture-of-experts routing replay: the trainer routes each token to the experts the engine (R3) or the "
        "old-policy pass (R2) routed it to.",
    )
    add_flag(
        g,
        "--use-rollout-routing-replay",
        action="store_true",
        help=(
            "R3 (Ma et al. 2025, 'Stabilizing MoE RL by aligning training and inference routers', arXiv:2510.11370; "
            "slime --use-rollout-routing-replay): the engine records the experts each token was routed to, and every "
            "trainer forward on the rollout (old and reference log-probs, the training pass) uses exactly those "
            "experts, so routing no longer adds to the train-inference mismatch. Use with MoE models whose runs "
            "collapse from routing drift. Needs an MoE --hf-checkpoint and an engine that records (hf)."
        ),
    )
    add_flag(
        g,
        "--use-routing-replay",
        action="store_true",
        help=(
            "R2 (routing replay of the GSPO report, arXiv:2507.18071; slime --use-routing-replay): the old-log-prob "
            "pass records the trainer's routing and the training passes replay it, so later optimizer steps on the "
            "same rollout keep the old policy's experts. With --use-rollout-routing-replay it means R3, as in slime."
        ),
    )

    add_flag(
        g,
        "--debug-engine-routing-flip",
        type=float,
        default=0.0,
        help=(
            "Test hook: the hf engine sends about this fraction of the tokens in every MoE layer to their top k-1 "
            "and (k+1)-th expert instead of the top k (as another kernel or a near tie flips a real engine's "
            "choice), so its routing disagrees with the trainer's on purpose; the mismatch/* metrics with and "
            "without --use-rollout-routing-replay then show what R3 removes. 0 (the default): off."
        ),
    )


def validate(args):
    flip = args.debug_engine_routing_flip
    if not 0.0 <= flip <= 1.0:
        fail(f"--debug-engine-routing-flip {flip}", "it is a fraction of tokens, in [0, 1]", "e.g. 0.3, or 0 (off)")
    if flip and args.rollout_engine != "hf":
        fail(
            f"--debug-engine-routing-flip with --rollout-engine {args.rollout_engine}",
            "the hook flips the hf engine's routers",
            "--rollout-engine hf",
        )
    mode = routing_replay_mode(args)
    if mode is None:
        return
    flag = "--use-rollout-routing-replay" if mode == "rollout" else "--use-routing-replay"
    if mode == "rollout" and args.rollout_engine in ENGINE_REFUSALS:
        fail(flags_of(args.rollout_engine), *ENGINE_REFUSALS[args.rollout_engine])
    hook = "--custom-generate-function-path" if args.custom_generate_function_path else None
    hook = hook or ("--rollout-function-path" if args.rollout_function_path else None)
    if mode == "rollout" and hook:
        fail(
            f"--use-rollout-routing-replay with {hook}",
            "generate_tokens does not return the engine's routed experts yet, so a hook's samples carry none to replay",
            f"drop one, or use --use-routing-replay (R2: the trainer's own old-pass routing) with {hook}",
        )
    if not args.hf_checkpoint:
        fail(
            flag,
            "routing replay needs a mixture-of-experts model; the embedded default model is dense",
            "pass an MoE --hf-checkpoint",
        )
    if os.path.exists(os.path.join(str(args.hf_checkpoint), "config.json")) and not checkpoint_num_experts(
        args.hf_checkpoint
    ):
        fail(
            f"{flag} with --hf-checkpoint {args.hf_checkpoint}",
            "it is a dense model (its config.json names no num_experts / num_local_experts / n_routed_experts)",
            "pass a mixture-of-experts --hf-checkpoint, or drop the flag",
        )
    if mode == "old" and args.use_rollout_logprobs:
        fail(
            "--use-routing-replay with --use-rollout-logprobs",
            "R2 records the routing of the trainer's old-log-prob pass, which --use-rollout-logprobs skips "
            "(the engine's log-probs are the old ones)",
            "drop one, or use --use-rollout-routing-replay (R3: the engine's routing)",
        )
