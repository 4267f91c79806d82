"""Issue 37 #12: routing replay never pins padding or unrun tokens to experts ``0..k-1``, and the
router losses count real tokens only.

Positions no engine routed (the bshd padding, the SP padding segment, the padded-grid cells, each
sample's last token) are ``UNROUTED`` (-1): the replays route them by the trainer's own top-k
(``routing.layout.own_where_unrouted``), so they spread over the experts as they would without
replay; pinned to experts 0..k-1 they all landed on EP rank 0 and inflated those experts' counts.
Megatron's forward passes megatron-core's ``padding_mask``, so its aux loss and z-loss count the
real tokens only, as the FSDP backend's router losses do.

The step: 6 samples of 12 tokens each (prompt 5, response 7), every token but a sample's last
carrying replayed experts. Megatron in bshd with ``--seq-length 16`` routes 4 padding positions per
row (the tail of its sequence-major token order); in thd there is no padding. With R3 and the aux
losses on, Megatron bshd, Megatron thd and FSDP report the same ``moe_load_balancing_loss`` and
``moe_z_loss``, and Megatron bshd's padding rows are routed by the router's own top-k.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.tolerance import FP32_MODEL, within

AUX = ("--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001")
N, PROMPT, RESPONSE, SEQ = 6, 5, 7, 16
LAYERS, TOP_K, EXPERTS = 2, 2, 8


def _batch():
    from rl_plugin.loss import StepBatch
    from rl_plugin.routing.layout import pad_experts

    g = torch.Generator().manual_seed(11)
    total = PROMPT + RESPONSE
    # the engine's experts: a random top-k set per token (distinct ids), the last token unrouted
    ran = torch.rand(N, total - 1, LAYERS, EXPERTS, generator=g).argsort(-1)[..., :TOP_K].to(torch.int16)
    routed = torch.cat([ran, pad_experts(N, LAYERS, TOP_K)[:, None]], dim=1).reshape(N * total, LAYERS, TOP_K)
    r = N * RESPONSE
    return StepBatch(
        tokens=torch.randint(1, 128, (N * total,), generator=g),
        total_lengths=torch.full((N,), total),
        response_lengths=torch.full((N,), RESPONSE),
        loss_mask=torch.ones(r),
        advantages=torch.linspace(-1, 1, r),
        group_ids=torch.arange(N) // 2,
        routed_experts=routed,
    ).validate()


def _routing_maps(backend, batch):
    """``(replayed, own)`` routing maps ``[s * b, E]`` of every router call of a forward-only pass:
    what the router dispatched, and its own top-k of the same logits."""
    from rl_plugin.backends.megatron.forward import unwrap
    from rl_plugin.backends.megatron.routing_replay import routers_of

    maps = []

    def hook(module, args, out):
        with torch.no_grad():
            logits = module.gating(args[0]).reshape(-1, EXPERTS)
            own = torch.zeros_like(out[1]).scatter(1, logits.topk(TOP_K, dim=-1).indices, True)
        maps.append((out[1].detach().clone(), own))

    routers = routers_of(unwrap(backend.model[0] if isinstance(backend.model, list) else backend.model))
    handles = [r.register_forward_hook(hook) for r in routers]
    try:
        logp = backend.compute_log_probs(batch)
    finally:
        for h in handles:
            h.remove()
    return maps, logp


def _worker(rank, world, ckpt):
    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from tests.support.megatron_common import make_args

    bshd = ("--qkv-format", "bshd", "--seq-length", str(SEQ))
    runs = {
        "megatron_bshd": (MegatronBackend, (*bshd, "--use-rollout-routing-replay")),
        "megatron_thd": (MegatronBackend, ("--use-rollout-routing-replay",)),
        "fsdp": (FSDPBackend, ("--train-backend", "fsdp", "--use-rollout-routing-replay")),
    }
    out = {}
    for name, (cls, extra) in runs.items():
        flags = ["--hf-checkpoint", ckpt, "--lr", "1e-3", "--micro-batch-size", "3", *AUX, *extra]
        backend = cls.from_args(make_args(*flags, world_size=world))
        batch = _batch()
        maps = None
        if name == "megatron_bshd":
            maps, old = _routing_maps(backend, batch)
        else:
            old = backend.compute_log_probs(batch)
        batch.old_log_probs = old
        report = backend.train_step(batch, num_groups=N // 2)
        out[name] = dict(maps=maps, report=report)
    return out


@pytest.fixture(scope="module")
def runs(run_world, tmp_path_factory):
    from rl_plugin.models.tiny import make_tiny_moe_checkpoint

    ckpt = str(make_tiny_moe_checkpoint(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe", num_experts=EXPERTS))
    return run_world(_worker, 1, ckpt)[0]


def test_padding_rows_are_routed_by_the_trainers_router_not_pinned(runs):
    maps = runs["megatron_bshd"]["maps"]
    assert maps
    pinned = torch.zeros(EXPERTS, dtype=torch.bool)
    pinned[:TOP_K] = True
    load = torch.zeros(EXPERTS, dtype=torch.long)
    for routed, own in maps:
        rows = routed.shape[0] // SEQ  # the micro-batch's samples; sequence-major: padding is the tail
        pad = slice((PROMPT + RESPONSE) * rows, None)
        assert torch.equal(routed[pad], own[pad])  # the router's own top-k (before: experts 0..k-1)
        load += routed[pad].sum(0)
    print(f"padding tokens per expert under replay: {load.tolist()}")
    assert int(load[~pinned].sum()) > 0  # not all on experts 0..k-1 (EP rank 0)
    assert any(not torch.equal(r, o) for r, o in maps)  # the real tokens do take the replayed experts


@pytest.mark.parametrize("name", ["moe_load_balancing_loss", "moe_z_loss"])
def test_router_losses_under_replay_count_real_tokens_only(runs, name):
    got = {k: v["report"][name] for k, v in runs.items()}
    print(f"{name} with R3: {got}")
    ref = got["fsdp"]  # the FSDP router losses read the real-token rows only
    assert ref > 0
    for k, v in got.items():
        assert within(v, ref, rtol=FP32_MODEL), (k, v, ref)  # before: bshd also counted its padding
