"""The CPU shim: each patch is needed on a CPU-only torch (the megatron-core call fails without
it) and works with it; applied once; never applied when CUDA is present. The shim changes
process-wide state, so everything that applies it runs in a spawned process."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def _failures():
    """Which megatron-core calls raise, right now, in this process."""
    import types

    import numpy as np
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    from megatron.core.transformer.moe.moe_utils import RouterGatingLinearFunction
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as dispatcher
    from megatron.core.transformer.utils import get_default_causal_mask

    def dispatcher_dtoh():
        dispatcher.cuda_dtoh_stream or torch.cuda.Stream()  # the dispatcher's __init__ (l. 444-445)
        d = types.SimpleNamespace(drop_and_pad=False, cuda_dtoh_point="p", cuda_sync_point="p", num_local_experts=1)
        d.cuda_dtoh_stream = dispatcher.cuda_dtoh_stream
        d.input_splits, d.output_splits, d.output_splits_tp = torch.tensor([1, 2]), torch.tensor([3]), None
        d.num_out_tokens = torch.tensor(3)
        tokens = torch.tensor([4])
        assert dispatcher._maybe_dtoh_and_synchronize(d, "p", tokens) is tokens
        assert isinstance(d.input_splits, np.ndarray) and d.input_splits.tolist() == [1, 2]

    def raises(fn):
        try:
            fn()
            return False
        except Exception:  # noqa: BLE001 - any failure counts: the call does not work on CPU
            return True

    return {
        "rng_tracker": raises(lambda: CudaRNGStatesTracker().add("probe", 123)),
        "current_device": raises(lambda: torch.empty(1, device=torch.cuda.current_device())),
        "cuda_device_literals": raises(lambda: get_default_causal_mask(3)),
        "tensor_type_names": torch.zeros(1).type() != "torch.cuda.FloatTensor",  # megatron's check fails
        "cuda_synchronize": raises(torch.cuda.synchronize),
        "embedding_group_copy": raises(_tied_embedding_first_stage_setup),
        "moe_dispatcher_stream": raises(dispatcher_dtoh),
        "router_gemm_name": raises(
            lambda: RouterGatingLinearFunction.apply(torch.ones(2, 4), torch.ones(3, 4), None, torch.float32)
        ),
    }


def _tied_embedding_first_stage_setup():
    """``LanguageModule.setup_embeddings_and_output_layer`` as the first stage of a pipelined model
    with tied embeddings runs it (the copy to the last stage; a one-rank embedding group here)."""
    import types

    import torch.distributed as dist
    from megatron.core.models.common.language_module.language_module import LanguageModule

    weight = torch.nn.Parameter(torch.ones(2))
    stub = types.SimpleNamespace(
        pre_process=True,
        post_process=False,
        share_embeddings_and_output_weights=True,
        config=types.SimpleNamespace(pipeline_model_parallel_size=2, mtp_num_layers=0),
        embedding=types.SimpleNamespace(word_embeddings=types.SimpleNamespace(weight=weight)),
        vp_stage=None,
        vp_size=None,
        pp_group=dist.group.WORLD,
        embd_group=dist.group.WORLD,
    )
    stub._is_in_embd_group = types.MethodType(LanguageModule._is_in_embd_group, stub)
    stub.shared_embedding_or_output_weight = types.MethodType(LanguageModule.shared_embedding_or_output_weight, stub)
    LanguageModule.setup_embeddings_and_output_layer(stub)
    assert torch.equal(weight.data, torch.ones(2))


def _shim_worker(rank, world):
    import importlib

    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    from rl_plugin.backends.megatron.compat import cpu_shim

    before = _failures()
    original_zeros = torch.zeros
    names = cpu_shim.patches_needed(cuda=False, te=False)
    assert cpu_shim.apply_cpu_shim() == names
    assert cpu_shim.apply_cpu_shim() == names  # idempotent
    after = _failures()
    # RNG fork: its own stream, the default stream restored on exit.
    tracker = CudaRNGStatesTracker()
    tracker.add("mp", 7)
    state = torch.get_rng_state()
    with tracker.fork("mp"):
        a = torch.rand(3)
    restored = torch.equal(torch.get_rng_state(), state)
    with tracker.fork("mp"):
        b = torch.rand(3)
    schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    return {
        "before": before,
        "after": after,
        "applied": list(cpu_shim.APPLIED),
        "rng_restored": restored,
        "rng_advances": not torch.equal(a, b),
        "global_torch_untouched": torch.zeros is original_zeros,
        "module_proxy": schedules.torch is not torch and schedules.torch.zeros(1, device="cuda").device.type == "cpu",
        "conversion_still_converts": torch.zeros(1).type(torch.float64).dtype == torch.float64,
    }


def test_each_patch_is_needed_and_works_and_applies_once(run_world):
    out = run_world(_shim_worker, 1)[0]
    from rl_plugin.backends.megatron.compat.cpu_shim import PATCHES

    names = [n for n, _, _ in PATCHES]
    assert out["applied"] == names
    assert out["before"] == {n: True for n in names}, out["before"]  # each call fails unpatched
    assert out["after"] == {n: False for n in names}, out["after"]
    assert out["rng_restored"] and out["rng_advances"]
    assert out["global_torch_untouched"] and out["module_proxy"] and out["conversion_still_converts"]


def test_shim_is_not_applied_on_a_gpu_with_transformer_engine(monkeypatch):
    from rl_plugin.backends.megatron.compat import cpu_shim

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpu_shim, "te_present", lambda: True)
    applied_before = list(cpu_shim.APPLIED)
    assert cpu_shim.apply_cpu_shim() == []
    assert cpu_shim.APPLIED == applied_before == []
    assert not cpu_shim.shim_active()
