"""Mixture-of-experts routing replay (R3 ``--use-rollout-routing-replay``, R2 ``--use-routing-replay``):
every piece of it but the flags (``rl_plugin.arguments.routing_replay``).

The routed experts of a token are, per MoE layer, the ``top_k`` expert ids its router chose. The
engine records them for every token it ran through the model (``hf``: ``hf.RoutingRecorder``);
the rollout carries them as one flat int tensor ``[sum T_i, num_moe_layers, top_k]``
(``RolloutData.routed_experts`` -> ``StepBatch.routed_experts``); a backend's forward replays
them (Megatron: megatron-core's ``RouterReplay``, ``rl_plugin.backends.megatron.routing_replay``;
FSDP / HF: ``rl_plugin.backends.fsdp.routing_replay`` over ``hf.replay_routing``). ``layout`` puts
a micro-batch's routed experts in the order its model input holds the tokens.

This package is backend-independent (foundations layer, torch only):

- ``mode``: the one replay mode a run's flags ask for (``"rollout"``, ``"old"`` or None).
- ``engines``: why the vllm / sglang engines cannot record routed experts (the refusal's words).
- ``hf``: the Hugging Face routers of a model, recording and replaying their top-k (the hf engine
  and the FSDP backend).
- ``layout``: routed experts of a micro-batch in model-input order, the agreement counter.
- ``passes``: which pass of a backend replays or records, the assembly of a recorded pass, the
  ``routing/topk_agree_frac`` metric.

The backend-specific replays live with their backends: ``backends/megatron/routing_replay.py``
(megatron-core's ``RouterReplay`` and its token order) and ``backends/fsdp/routing_replay.py``
(the HF routers in the FSDP backend's model-input order).
"""
