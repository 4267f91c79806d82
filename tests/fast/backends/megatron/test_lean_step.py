"""The lean Megatron step (issue 12) is bitwise the plain one: same reports, gradients and updated
weights.

The local layer spec's per-layout caches (``local_attention.PackedGrid``: the padded grid's
``index_select`` pad and unpad; ``rope_thd.RopeTables``: RoPE's cos / sin once per layout, dense)
replace per-layer work by the same values. One gloo rank, the tiny Qwen2, an embedded-shaped
batch (short samples, so the padded grid is chosen) in two micro-batches of different layouts
(the caches must follow the layout), one ``train_rollout`` from the same fresh state twice: lean,
then with the plain formulas patched in (megatron-core's own per-sample RoPE loop, and the
advanced-index pad + transpose + boolean unpad). Bitwise is legitimate: the same kernels run on
the same values (``backends/megatron/compat/test_packed_attention`` checks each piece alone).
"""

from __future__ import annotations

import torch


def plain_padded_forward(self, query, key, value, cu, attn_mask_type, attention_bias):
    """The padded form as the lean one's reference: ``x[gather]`` then transpose, ``y[valid]``."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from rl_plugin.cp import segment_grid

    gather, valid = segment_grid(cu.to(query.device))
    width = gather.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=query.device).triu(1).view(1, 1, width, width)
    q, k, v = (x[gather].transpose(0, 1).contiguous() for x in (query, key, value))
    out = DotProductAttention.forward(
        self, q, k, v, causal, attn_mask_type=attn_mask_type, attention_bias=attention_bias
    )
    return out.transpose(0, 1)[valid]


def _worker(rank, world, hf_dir):
    from dataclasses import replace

    from megatron.core.models.common.embeddings import rope_utils

    from rl_plugin.arguments import parse_args
    from rl_plugin.backends.megatron.compat import rope_thd
    from rl_plugin.backends.megatron.compat.local_attention import VarlenDotProductAttention
    from rl_plugin.configs import TrainConfig
    from rl_plugin.ray.train_actor import TrainActor, backend_class
    from rl_plugin.step_plan import RankPlan
    from tests.support.megatron_common import synthetic_batch

    args = parse_args(
        ["--train-backend", "megatron", "--hf-checkpoint", hf_dir, "--micro-batch-size", "16", "--lr", "0.01"]
    )
    config = TrainConfig.from_args(args)
    backend = backend_class("megatron").from_config(config)
    actor = TrainActor(rank, world)
    actor.config, actor.backend = config, backend
    batch, groups = synthetic_batch(seed=3, num_prompts=8, n_per_prompt=4, max_prompt=5, max_response=4)
    params = list(backend.model.parameters())
    start = [p.detach().clone() for p in params]  # the fresh state (Adam's is empty before a step)
    schedule = backend.scheduler.state_dict()
    lean = (rope_utils._apply_rotary_pos_emb_thd, VarlenDotProductAttention._padded_forward)
    out = {}
    for name in ("lean", "plain"):
        if name == "plain":
            rope_utils._apply_rotary_pos_emb_thd = rope_thd._ORIGINAL["fn"]
            VarlenDotProductAttention._padded_forward = plain_padded_forward
        with torch.no_grad():
            for p, p0 in zip(params, start):
                p.copy_(p0)
        for opt in getattr(backend.optimizer, "chained_optimizers", [backend.optimizer]):
            opt.optimizer.state.clear()
        backend.scheduler.load_state_dict(schedule)
        reports = actor.train_rollout(RankPlan(replace(batch), [(0, batch.num_samples)], [groups])).reports
        grads = {n: p.main_grad.clone() for n, p in backend.model.named_parameters()}
        out[name] = (reports[0], grads, backend.export_hf_state_dict())
    rope_utils._apply_rotary_pos_emb_thd, VarlenDotProductAttention._padded_forward = lean
    return out


def test_lean_megatron_step_is_bitwise_the_plain_one(run_world, tiny_qwen2):
    hf_dir = tiny_qwen2
    out = run_world(_worker, 1, hf_dir)[0]
    (a, grads_a, w_a), (b, grads_b, w_b) = out["lean"], out["plain"]
    diff = {k: (a[k], b[k]) for k in a if not k.startswith("time/") and a[k] != b[k]}
    assert not diff, diff
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 10
    for n, g in grads_a.items():
        assert torch.equal(g, grads_b[n]), n
    assert any(g.abs().sum() > 0 for g in grads_a.values())
    for n, w in w_a.items():
        assert torch.equal(w, w_b[n]), n
