"""Upstream workarounds of the Megatron backend: what megatron-core 0.16.1 and mbridge 0.15.1 (the
pinned releases, ``scripts/constraints.txt``) need to run here. The backend proper lives one folder
up; nothing in this package is imported at import time of ``rl_plugin.backends.megatron``.

Each workaround names the upstream version that needs it and has a probe test that fails when it
stops being needed or stops working (``tests/fast/backends/megatron/compat/`` unless said). When a
probe fails at its "fails here" line after a version bump, upstream fixed it: delete the
workaround, its probe and its line here. No upstream issue was found for any of them (searched the
Megatron-LM and mbridge issues) except where one is named.

| module | what | upstream | why | delete when |
| --- | --- | --- | --- | --- |
| ``cpu_shim`` (8 patches: RNG tracker, ``current_device``, ``"cuda"`` literals, ``Tensor.type()`` names, ``cuda.synchronize``, tied-embedding copy, MoE D2H stream, router GEMM name) | megatron-core on a CPU under gloo: 1-7 only without CUDA, 8 wherever transformer-engine is absent (GPUs too; ``cpu_shim.needed``) | megatron-core 0.16.1 (0.19 still needs 1-7, no longer 8) | hard-coded CUDA calls (line numbers in the module) | megatron-core runs on CPU itself, or CPU runs are dropped; probe ``test_cpu_shim.py`` runs each failing call with and without its patch |
| ``cpu_shim.cpu_config_overrides`` | fusions off on CPU (masked softmax, bias+act, bias+dropout, RoPE, grad-acc fusion, shared-expert overlap); the masked softmax also on a GPU without transformer-engine | mbridge 0.15.1 (turns fusions on) / megatron-core 0.16.1 (CUDA kernels; the fused causal softmax drops the packed samples' mask) | a CUDA kernel or apex per fusion | never on CPU; ``tests/fast/backends/megatron/test_setup.py``, ``compat/test_without_te.py`` (probe of the dropped mask) |
| ``one_rank_collectives`` | skips a SUM/MAX/MIN all-reduce over a one-rank group (grad norm, zero count, DDP grad sync at DP 1); CPU only | megatron-core 0.16.1 ``clip_grads.py``, ``param_and_grad_buffer.py`` | gloo's round trip for an identity (~1.2 ms a step); bitwise equal | megatron-core skips one-rank groups; probe ``test_one_rank_collectives.py`` |
| ``local_attention`` (``VarlenDotProductAttention``) | packed ``thd`` attention on the local (no-TE) spec | megatron-core 0.16.1 ``DotProductAttention`` asserts ``packed_seq_params is None`` | only TE has a thd kernel | megatron-core's local attention takes packed sequences; probe ``test_packed_attention.py::test_local_attention_refuses_thd_upstream`` |
| ``rope_thd`` | the unfused thd RoPE without the per-sample Python loop (bitwise equal); CPU only | megatron-core 0.16.1 ``rope_utils._apply_rotary_pos_emb_thd`` | ~1000 loop iterations a rollout on the embedded run | megatron-core vectorises it; probe ``test_packed_attention.py`` (bitwise, and the install finds both call sites) |
| ``dist_optimizer`` | the distributed optimizer's state before the first step (Adam's ``step``, SGD's missing ``init_state_fn``), the fully-reshardable save of a multi-bucket buffer, the shared ``step`` tensor and the ``step`` key on load | megatron-core 0.16.1 ``distrib_optimizer.py`` (the bucket offsets: its own TODO, issue #504) | an assert, shifted values in a resharded checkpoint, Adam's bias correction drifting after a resume | megatron-core fixes each; probes ``tests/fast/backends/megatron/test_checkpoint.py`` (bitwise resume) and ``test_reshard*.py`` |
| ``mbridge_fixes`` 1 ``fix_rope_theta`` | copies ``rope_parameters['rope_theta']`` onto the HF config | mbridge 0.15.1 with transformers >= 5 | mbridge reads ``hf_config.rope_theta`` | mbridge reads ``rope_parameters``; probe ``test_mbridge_fixes.py`` |
| ``mbridge_fixes`` 2 ``local_spec_bridge_class`` | the local layer spec and its norm names | mbridge 0.15.1 | mbridge builds and names only the TE spec | mbridge supports the local spec; probe ``test_mbridge_fixes.py`` |
| ``mbridge_fixes`` 3 ``sequential_experts_bridge_class`` | MoE experts as ``SequentialMLP`` names and TP split | mbridge 0.15.1 | mbridge names only ``TEGroupedMLP`` experts | as 2; probe ``test_mbridge_fixes.py`` |
| ``mbridge_fixes`` 4 ``tied_embeddings_bridge_class`` | one name map per bridge instance | mbridge 0.15.1 Qwen2Bridge / LLaMABridge | the class map is mutated for a tied model; Llama maps no tied head | mbridge copies the map; probe ``test_mbridge_fixes.py`` |
| ``mbridge_fixes`` 5 ``FAMILY_FIXES`` | Mixtral ``moe_router_pre_softmax=False``, Qwen2-MoE / Qwen3-MoE ``moe_router_pre_softmax = not norm_topk_prob``, Qwen2-MoE ``moe_shared_expert_gate=True`` | mbridge 0.15.1 MixtralBridge / Qwen2MoEBridge / Qwen3MoEBridge | another model than HF's (logits differ) | mbridge sets them as HF does; probes ``test_mbridge_fixes.py`` and ``tests/fast/moe/test_megatron_moe.py`` |
| ``mbridge_vl`` (8 fixes, ``vl_bridge_class``, ``VarlenFullAttention``) | mbridge's Qwen2.5-VL bridge building on the local specs: no TE specs, the checkpoint's own vision sizes, transformers 5's ``text_config`` / ``rope_parameters``, the local norms' names, one name map per bridge, ``rotary_pos_cos_sin`` on its attention, the merger's TP split with its own (non-gated) config, transformers 5's weight names in the export; the vision tower's bidirectional packed attention | mbridge 0.15.1 ``models/qwen2_5_vl`` on megatron-core 0.16.1 | TE-only provider, hard-coded 7B vision config, wrong merger shards under TP > 1, a TypeError in every layer | mbridge fixes each; probes ``test_mbridge_vl.py`` (one per fix), the model's parity in ``tests/fast/backends/megatron/test_vision.py`` |

Workarounds that stay beside the code they repair (each names megatron-core 0.16.1 there):

- ``checkpoint.py``: the synchronous ``torch_dist`` save (``_sync_torch_dist_strategy``: megatron-core
  0.16.1 always saves through forked writer processes), part of the save path the checkpoint
  layout owns; pinned by ``tests/fast/backends/megatron/test_checkpoint.py``.
- ``setup.py``: ``perform_initialization=True`` (megatron-core 0.16.1 sets the TP attributes only
  while initialising) and the refusals of layouts megatron-core 0.16.1 cannot train.
- ``bridge._export_one_stage``: mbridge 0.15.1's ``export_weights`` minus its per-parameter PP
  collectives at one stage (a speed-up; equal tensor by tensor, ``test_bridge.py``).

``docs/megatron_core_0_19.md`` records what a move to megatron-core 0.19 changes here.
"""
