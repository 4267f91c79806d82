"""LoRA on the FSDP backend (PEFT before fully_shard): real FSDP2 on gloo, tiny Qwen2, fp32.

- At init every lora_A equals ``rl_plugin.lora.init.initial_lora_a(canonical name, r, in, seed)``
  and every lora_B is zero (not PEFT's global-RNG draw), so the first forward is the base's: the
  actor's log-probs equal the reference's (adapters disabled) bit for bit.
- Only adapters train: the optimizer holds only them, and after a step every base tensor (the
  targeted linears' ``base_layer`` weights, embeddings, norms, head) is bitwise the checkpoint's.
- DP1 vs DP2 (samples split 5/4, a prompt group straddling the ranks): J, the grad norm and every
  adapter gradient (gathered full) agree within ``FP32_MODEL`` for every --loss-aggregation mode,
  GSPO, PPO + KL (the reference = the base, adapters off) and token-level TIS; the step moves the
  adapters (B leaves zero).
"""

from __future__ import annotations

import pytest
import torch

from rl_plugin.lora.init import initial_lora_a
from tests.support.fsdp_common import fsdp_flags, make_step, parse, step_batch
from tests.support.tolerance import FP32_MODEL, tensor_within, within

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--target-modules", "all-linear", "--adam-eps", "1e-2", "--lr", "0.1"]
CONFIGS = {
    "sample_mean": [],
    "token_mean": ["--loss-aggregation", "token_mean"],
    "prompt_mean": ["--loss-aggregation", "prompt_mean"],
    "constant": ["--loss-aggregation", "constant", "--loss-aggregation-divisor", "8"],
    "gspo": ["--advantage-estimator", "gspo", "--loss-aggregation", "token_mean"],
    "kl": ["--use-kl-loss", "--kl-loss-coef", "0.1"],
    "tis": ["--use-tis", "--tis-mode", "mask", "--tis-clip-low", "0.8", "--tis-clip", "1.25"],
}
SEED = 7  # fsdp_flags' --seed


def full_grads(backend) -> dict:
    """Every adapter's gradient, gathered whole (collective), canonical names."""
    from torch.distributed.tensor import DTensor

    from rl_plugin.backends.fsdp.lora import is_adapter_key
    from rl_plugin.lora.names import canonical_name

    out = {}
    for name, p in backend.model.named_parameters():
        if is_adapter_key(name):
            g = p.grad
            out[canonical_name(name)] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def capturing(backend, grads: dict):
    """``backend.optimizer_step`` that first stores every adapter's full gradient in ``grads``."""
    step_fn = backend.optimizer_step

    def step():
        grads.update(full_grads(backend))
        return step_fn()

    return step


def worker(rank, world, ckpt, step):
    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from rl_plugin.loss.micro_batch_plan import split_samples_for_dp

    local = step_batch(step).select(split_samples_for_dp(9, world)[rank])
    results = {}
    for cname, cflags in CONFIGS.items():
        backend = FSDPBackend.from_args(parse(fsdp_flags(ckpt, *LORA, *cflags, "--micro-batch-size", "2")))
        init = dict(backend.stream_lora_adapters())
        actor, reference = backend.compute_log_probs(local), backend.compute_log_probs(local, role="ref")
        grads = {}
        backend.optimizer_step = capturing(backend, grads)
        report = backend.train_step(local, num_groups=3)
        trained = dict(backend.stream_lora_adapters())
        n_opt = sum(p.numel() for group in backend.optimizer.param_groups for p in group["params"])
        n_adapters = sum(t.numel() for t in backend.lora_adapter_specs().values())
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        base = get_model_state_dict(backend.model, options=StateDictOptions(full_state_dict=True))
        base = {k: v.detach().clone() for k, v in base.items() if ".lora_" not in k}
        results[cname] = dict(
            report=report,
            grads=grads,
            init=init if rank == 0 else None,
            trained=trained if rank == 0 else None,
            same_at_init=torch.equal(actor, reference),
            n_opt=n_opt,
            n_adapters=n_adapters,
            base=base if rank == 0 and cname == "sample_mean" else None,
        )
    return results


@pytest.fixture(scope="module")
def runs(run_world, tiny_qwen2):
    step = make_step(0)
    g = torch.Generator().manual_seed(3)  # the engine's log-probs (TIS): old + noise, ~1 token in 7 out of band
    step["rollout_log_probs"] = step["old_log_probs"] + 0.15 * torch.randn(step["old_log_probs"].shape, generator=g)
    return tiny_qwen2, {world: run_world(worker, world, tiny_qwen2, step) for world in (1, 2)}


def test_adapters_start_from_initial_lora_a_and_zero_b(runs):
    _, by_world = runs
    init = by_world[1][0]["sample_mean"]["init"]
    a_names = [n for n in init if n.endswith("lora_A.weight")]
    assert len(a_names) == 2 * 7  # 2 layers x q/k/v/o/gate/up/down
    for name in a_names:
        a = init[name]
        assert torch.equal(a, initial_lora_a(name, a.shape[0], a.shape[1], SEED)), name
        assert torch.count_nonzero(init[name.replace("lora_A", "lora_B")]) == 0
    for world in (1, 2):
        for r in by_world[world]:
            assert all(res["same_at_init"] for res in r.values())  # B = 0: actor == base bit for bit
    assert by_world[2][0]["sample_mean"]["init"].keys() == init.keys()
    assert all(torch.equal(init[k], by_world[2][0]["sample_mean"]["init"][k]) for k in init)


def test_only_adapters_train_and_base_is_bitwise_unchanged(runs):
    from safetensors.torch import load_file

    ckpt, by_world = runs
    res = by_world[2][0]["sample_mean"]
    assert res["n_opt"] * 2 >= res["n_adapters"] > 0  # each rank's optimizer: its shards of the adapters only
    initial = load_file(f"{ckpt}/model.safetensors")
    base = {k.replace(".base_layer.", "."): v for k, v in res["base"].items()}
    for name, value in initial.items():
        assert torch.equal(base[name], value), name  # bitwise the checkpoint's after a step at lr 0.1
    moved = [n for n, t in res["trained"].items() if n.endswith("lora_B.weight") and torch.count_nonzero(t)]
    assert len(moved) == 14


@pytest.mark.parametrize("cname", list(CONFIGS))
def test_dp1_equals_dp2(runs, cname):
    _, by_world = runs
    one, two = by_world[1][0][cname], by_world[2][0][cname]
    for other in by_world[2][1:]:
        assert other[cname]["report"] == two["report"]
    scale = 8.0  # |log-probs|, |advantages| of the step: the terms that cancel in J
    assert within(one["report"]["loss"], two["report"]["loss"], rtol=FP32_MODEL, scale=scale)
    assert within(one["report"]["grad_norm"], two["report"]["grad_norm"], rtol=FP32_MODEL)
    assert one["report"]["grad_norm"] > 1e-4
    assert one["grads"].keys() == two["grads"].keys() and len(one["grads"]) == 28
    for name, g in one["grads"].items():
        assert tensor_within(two["grads"][name], g, rtol=FP32_MODEL), name
    for name, t in one["trained"].items():
        assert tensor_within(two["trained"][name], t, rtol=FP32_MODEL), name
