"""One rank of the Megatron backend with LoRA (tiny Qwen2, ``--lora-rank 4 --target-modules
all-linear``) reporting what ``lora_checkpoint`` and ``lora_export`` give: the worker of
``tests/fast/backends/megatron/test_lora_checkpoint.py`` and ``test_lora_export.py`` (one spawn,
through the folder's ``conftest.py``)."""

from __future__ import annotations

import torch

from tests.support.flags import EXACT_SGD

LORA = ("--lora-rank", "4", "--lora-alpha", "8", "--target-modules", "all-linear")


def adapter_state_worker(rank, world, hf_dir):
    import zlib

    from rl_plugin.backends.megatron import lora_checkpoint, lora_export
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from rl_plugin.backends.megatron.lora_model import local_adapters
    from tests.support.megatron_common import make_args

    backend = MegatronBackend.from_args(make_args("--hf-checkpoint", hf_dir, *EXACT_SGD, *LORA, world_size=world))
    model = backend.model
    specs = backend.lora_adapter_specs()
    sharded = lora_checkpoint.model_sharded_state_dict(model)
    out = {
        "names": list(sharded),
        "spec_names": list(specs),
        "keys_match": all(t.key == name for name, t in sharded.items()),
        "shapes_match": all(tuple(sharded[n].global_shape) == tuple(specs[n].shape) for n in specs),
        "data_is_param": all(sharded[n].data is p for n, p, _, _ in local_adapters(model)),
        "stage_specs": [(n, s, d) for n, s, d in lora_export.stage_specs(model)],
        "spec_dtypes": {str(m.dtype) for m in specs.values()},
    }
    given = {}
    for name, meta in specs.items():
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        given[name] = torch.randn(meta.shape, generator=g)
    lora_checkpoint.load_model_state(model, given)
    streamed = dict(backend.stream_lora_adapters())
    out["loaded"] = list(streamed) == list(given) and all(torch.equal(streamed[n], given[n]) for n in given)
    first, param, _, _ = local_adapters(model)[0]
    with torch.no_grad():
        param.add_(1.0)  # the weights change: a streamed tensor is a copy, not the parameter
    out["copies"] = torch.equal(streamed[first], given[first])
    stages = lora_export.adapter_stage_specs(model, None)
    out["one_stage"] = len(stages) == 1 and stages[0] == lora_export.stage_specs(model)
    quiet = lora_export.stream_adapters(model, stages, dp_rank=1, cp_rank=0, tp_rank=0, pp_rank=0, pp_group=None)
    out["dp1_streams_nothing"] = list(quiet) == []
    return out
