"""Cross-backend LoRA parity: FSDP (PEFT) and Megatron (adapters on megatron-core's linears) train
the same adapters.

Same tiny HF checkpoint, same seed, LoRA rank 4 / alpha 8 on all-linear, DP=2 on gloo, fp32,
plain SGD at lr 1 (``EXACT_SGD``: the update IS the applied gradient). Both backends stream their
adapters under the canonical PEFT names (``stream_lora_adapters``): at init they are bitwise equal
(``initial_lora_a`` from (seed, name, shape), B = 0); after one step of each case the per-token
log-probs, J, the grad norm and every adapter's update agree within ``tolerance.FP32_MODEL``.

Runs once the Megatron backend streams adapters (the i34-megatron branch); skipped before.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from tests.support.flags import EXACT_SGD
from tests.support.tolerance import FP32_MODEL, max_abs, within


def _megatron_streams_adapters() -> bool:
    if importlib.util.find_spec("rl_plugin.backends.megatron.backend") is None:
        return False
    from rl_plugin.backends.base import TrainBackend
    from rl_plugin.backends.megatron.backend import MegatronBackend

    return MegatronBackend.stream_lora_adapters is not TrainBackend.stream_lora_adapters


pytestmark = pytest.mark.skipif(not _megatron_streams_adapters(), reason="the Megatron backend has no LoRA yet")

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--target-modules", "all-linear"]
BASE = [*EXACT_SGD, "--rollout-temperature", "0.9", "--n-samples-per-prompt", "4", *LORA]
CASES = {
    "sample_mean": [],
    "token_mean": ["--loss-aggregation", "token_mean"],
    "gspo": ["--advantage-estimator", "gspo", "--loss-aggregation", "token_mean"],
    "kl": ["--use-kl-loss", "--kl-loss-coef", "0.1"],
}


def _worker(rank, world, hf_dir):
    from dataclasses import replace

    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from tests.support.megatron_common import dp_shard, make_args, synthetic_batch, with_old_log_probs

    batch, num_groups = synthetic_batch(seed=3, num_prompts=3, n_per_prompt=4, old_noise=0.3)
    out, init = {}, {}
    for case, flags in CASES.items():
        args = ["--hf-checkpoint", hf_dir, *BASE, *flags]
        backends = {
            "megatron": MegatronBackend.from_args(make_args(*args, world_size=world)),
            "fsdp": FSDPBackend.from_args(make_args("--train-backend", "fsdp", *args, world_size=world)),
        }
        ps = backends["fsdp"].parallel_state
        local0 = dp_shard(batch, ps.dp_size, ps.dp_rank)
        old = backends["fsdp"].compute_log_probs(local0)
        local = with_old_log_probs(local0, old)
        res = {}
        for name, backend in backends.items():
            a0 = {k: v.clone() for k, v in backend.stream_lora_adapters()}  # valid until the weights change
            init.setdefault(name, a0)
            step = local
            if "--use-kl-loss" in flags:
                step = replace(local, ref_log_probs=backend.compute_log_probs(local, role="ref"))
            logp = backend.compute_log_probs(step)
            report = backend.train_step(step, num_groups=num_groups)
            a1 = {k: v.clone() for k, v in backend.stream_lora_adapters()}
            res[name] = dict(report=report, logp=logp, update={k: a1[k] - a0[k] for k in a0} if rank == 0 else None)
        out[case] = res
    scale = max_abs(batch.old_log_probs, batch.advantages)
    return dict(out=out, init=init if rank == 0 else None, scale=scale)


@pytest.fixture(scope="module")
def results(run_world, tiny_qwen2):
    return run_world(_worker, 2, tiny_qwen2)


def test_adapters_start_identical(results):
    init = results[0]["init"]
    assert init["fsdp"].keys() == init["megatron"].keys() and len(init["fsdp"]) == 28
    for name, t in init["fsdp"].items():
        assert torch.equal(init["megatron"][name], t), name


@pytest.mark.parametrize("case", list(CASES))
def test_backends_train_the_same_adapters(results, case):
    r = results[0]
    m, f = r["out"][case]["megatron"], r["out"][case]["fsdp"]
    assert within(f["report"]["loss"], m["report"]["loss"], rtol=FP32_MODEL, scale=max(r["scale"], 8.0))
    assert within(f["report"]["grad_norm"], m["report"]["grad_norm"], rtol=FP32_MODEL)
    assert m["report"]["grad_norm"] > 1e-4
    num = math.sqrt(sum(float(((f["update"][k] - m["update"][k]).double() ** 2).sum()) for k in m["update"]))
    den = math.sqrt(sum(float((m["update"][k].double() ** 2).sum()) for k in m["update"]))
    assert num / den < FP32_MODEL, (case, num / den)
    lp = float((f["logp"] - m["logp"]).abs().max() / m["logp"].abs().max())
    assert lp < FP32_MODEL, (case, lp)
    print(f"\n{case}: update rel {num / den:.1e} logp rel {lp:.1e}")
