"""The vLLM engine's GPU settings (issue 37 item 8), seen through what it hands vLLM: CUDA graphs
unless asked otherwise on a GPU (eager on a CPU), ``max_model_len`` from
``--rollout-max-context-len``, and a bucket received on the GPU handed over without a host round
trip (a fake target device, "meta", shows where each tensor is). vLLM itself generating with
graphs on a GPU is a ``tests/gpu`` matter (no vLLM on the loaned GPU machine yet). Issue 44: the
prefix-cache reset after a load (refused by vLLM while requests hold blocks: left to the salt then,
an error when idle), and the OPD vLLM teacher's own memory share on a GPU."""

from __future__ import annotations

import pytest
import torch

from rl_plugin.configs import EngineConfig
from rl_plugin.models.tiny import make_tiny_hf_checkpoint

pytest.importorskip("vllm")


class _LLM:
    """Records the constructor's keyword arguments and every collective_rpc."""

    made = []
    busy = False  # requests in flight (vLLM then refuses a prefix-cache reset)
    resets_succeed = True

    def __init__(self, **kwargs):
        self.kwargs, self.rpcs, self.resets = kwargs, [], 0
        self.llm_engine = self  # has_unfinished_requests() lives on the LLMEngine
        _LLM.made.append(self)

    def has_unfinished_requests(self):
        return _LLM.busy

    def collective_rpc(self, method, args=(), kwargs=None):
        if method == "reload_weights":
            kwargs = dict(kwargs, weights_iterator=list(kwargs["weights_iterator"]))
        self.rpcs.append((method, args, kwargs))
        return [False]

    def reset_prefix_cache(self):
        self.resets += 1
        return _LLM.resets_succeed and not _LLM.busy


@pytest.fixture
def engine_module(monkeypatch):
    import vllm

    from rl_plugin.rollout.engines import vllm_engine

    monkeypatch.setattr(vllm, "LLM", _LLM)
    _LLM.made.clear()
    _LLM.busy, _LLM.resets_succeed = False, True
    return vllm_engine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "qwen2"))


@pytest.mark.parametrize(
    "device,flag,eager",
    [("cpu", None, True), ("cuda", None, False), ("cuda", True, True), ("cpu", False, False)],
)
def test_enforce_eager_follows_the_flag_else_the_device(engine_module, checkpoint, device, flag, eager):
    config = EngineConfig(engine="vllm", max_context_len=1024, enforce_eager=flag)
    engine_module.VLLMEngine.create(config, checkpoint, device=device)
    kwargs = _LLM.made[-1].kwargs
    assert kwargs["enforce_eager"] is eager
    assert kwargs["max_model_len"] == 1024  # --rollout-max-context-len reaches vLLM


def test_max_model_len_defaults_to_the_model_window(engine_module, checkpoint):
    from transformers import AutoConfig

    engine_module.VLLMEngine.create(EngineConfig(engine="vllm"), checkpoint, device="cuda")
    assert _LLM.made[-1].kwargs["max_model_len"] == AutoConfig.from_pretrained(checkpoint).max_position_embeddings


@pytest.mark.parametrize("device,tp,where", [("cuda", 1, "meta"), ("cuda", 2, "cpu"), ("cpu", 1, "cpu")])
def test_a_device_bucket_stays_on_the_device(engine_module, checkpoint, device, tp, where):
    """An in-process GPU worker takes the bucket where the distributed transport received it; a CPU
    engine or a multi-rank one (pickled RPC arguments) gets host tensors."""
    engine = engine_module.VLLMEngine(checkpoint, device=device, tensor_parallel_size=tp)
    make = (lambda: torch.zeros(2, 3, device="meta")) if where == "meta" else (lambda: torch.zeros(2, 3))
    engine.update_weights({"model.norm.weight": make()})
    ((method, _, kwargs),) = [r for r in _LLM.made[-1].rpcs if r[0] == "reload_weights"]
    assert [t.device.type for _, t in kwargs["weights_iterator"]] == [where]


def test_a_load_mid_generation_changes_the_salt_and_an_idle_refusal_fails_loud(engine_module, checkpoint):
    engine = engine_module.VLLMEngine(checkpoint, device="cpu")
    llm, salt = _LLM.made[-1], engine.cache_salt
    _LLM.busy = True  # a token-boundary load: vLLM would refuse, so it is not asked
    engine.update_weights({"model.norm.weight": torch.zeros(2, 3)})
    assert llm.resets == 0 and engine.cache_salt != salt
    _LLM.busy = False  # idle: the cache is dropped
    engine.update_weights({"model.norm.weight": torch.zeros(2, 3)})
    assert llm.resets == 1 and len({salt, engine.cache_salt}) == 2
    _LLM.resets_succeed = False
    with pytest.raises(RuntimeError, match="refused to reset its prefix cache with no request in flight"):
        engine.update_weights({"model.norm.weight": torch.zeros(2, 3)})


@pytest.mark.parametrize("device,share", [("cuda", 0.25), ("cpu", None)])
def test_the_vllm_teacher_takes_its_own_memory_share(engine_module, checkpoint, device, share):
    from rl_plugin.rollout.engines.teacher import make_teacher

    make_teacher("vllm", checkpoint, temperature=1.0, device=device, memory_share=0.25)
    assert _LLM.made[-1].kwargs.get("gpu_memory_utilization") == share  # not vLLM's default 0.9
