"""Generation engines: the interface and factory (``base``), the in-process Hugging Face engine
(``hf_engine`` + its sampler ``hf_sampler``), vLLM (``vllm_engine``) and an SGLang server client
(``sglang_engine``, with ``child_process``). Each is built from the run's ``EngineConfig``
(``base.make_engine``) and registered by name in ``rl_plugin.registries.ROLLOUT_ENGINES``; this
package imports none of them."""
