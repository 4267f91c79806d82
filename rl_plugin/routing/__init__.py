"""Mixture-of-experts routing replay (R3 ``--use-rollout-routing-replay``, R2 ``--use-routing-replay``).

The routed experts of a token are, per MoE layer, the ``top_k`` expert ids its router chose. The
engine records them for every token it ran through the model (``hf``: ``hf.RoutingRecorder``);
the rollout carries them as one flat int tensor ``[sum T_i, num_moe_layers, top_k]``
(``RolloutData.routed_experts`` -> ``StepBatch.routed_experts``); a backend's forward replays
them (Megatron: megatron-core's ``RouterReplay``, ``backends.megatron.routing_replay``; FSDP / HF:
``hf.replay_routing``). ``layout`` puts a micro-batch's routed experts in the order its model
input holds the tokens.

- ``hf``: the Hugging Face routers of a model, recording and replaying their top-k.
- ``layout``: routed experts of a micro-batch in model-input order, the agreement metric.
"""
