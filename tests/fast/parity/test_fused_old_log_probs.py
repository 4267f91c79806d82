"""No redundant forward (issue 12): a rollout trained in ONE optimizer step takes its old log-probs
from the training forward (detached) instead of a separate pass, with the same numbers.

Both backends, DP = 2 on gloo (rank 1 runs an idle FSDP pass: 5 / 4 samples, 2 per micro-batch),
the loop's own ``TrainActor.train_rollout``: the same rollout from the same checkpoint, once with
the separate pass and once fused, gives BITWISE identical reports (J, every metric including the
train-inference mismatch and TIS metrics) and updated weights (Adam). Bitwise is legitimate: the
fused path computes the same forward on the same micro-batches, and every downstream number is
the same function of the same values. Cases (entropy metrics on, so the training forward also
computes entropy, the separate pass does not): FSDP with PPO and token-level TIS; Megatron with
GSPO and sequence-level masked TIS. ``old_log_probs_rule`` keeps the separate pass where the numbers would
change (several steps, dropout, a custom TIS hook, CP with rollout log-probs).
"""

from __future__ import annotations

import tempfile

import pytest
import torch

CASES = {  # one per backend (each costs a backend build, a checkpoint and two rollouts)
    "fsdp": ["--use-tis", "--tis-clip", "1.05", "--pg-metrics", "with_entropy"],
    "megatron": [
        "--advantage-estimator",
        "gspo",
        "--use-tis",
        "--tis-level",
        "sequence",
        "--tis-mode",
        "mask",
        "--tis-clip-low",
        "0.9",
        "--tis-clip",
        "1.1",
        "--pg-metrics",
        "with_entropy",
    ],
}
TIME_KEYS = ("time/train_step", "time/log_probs")


def _worker(rank, world, backend_name, hf_dir):
    from dataclasses import replace

    from rl_plugin.arguments import parse_args
    from rl_plugin.configs import TrainConfig
    from rl_plugin.ray.train_actor import TrainActor, backend_class
    from rl_plugin.step_plan import RankPlan
    from tests.support.megatron_common import dp_shard, synthetic_batch

    def flags(*extra):
        return parse_args(
            [
                "--train-backend",
                backend_name,
                "--hf-checkpoint",
                hf_dir,
                "--actor-num-gpus-per-node",
                str(world),
                "--micro-batch-size",
                "2",
                "--lr",
                "0.1",
                "--adam-eps",
                "1e-2",
                *extra,
            ]
        )

    config = TrainConfig.from_args(flags(*CASES[backend_name]))
    backend = backend_class(backend_name).from_config(config)
    actor = TrainActor(rank, world)
    actor.config, actor.backend = config, backend
    forward_only = []
    log_probs = backend.runner.log_probs
    backend.runner.log_probs = lambda *a, **k: forward_only.append(1) or log_probs(*a, **k)  # count the passes

    batch, groups = synthetic_batch(seed=5, num_prompts=3, n_per_prompt=3, max_prompt=6, max_response=9)
    local = dp_shard(batch, world, rank)
    lp = backend.compute_log_probs(local)  # a first step, so the checkpoint holds Adam's state
    backend.train_step(replace(local, old_log_probs=lp, rollout_log_probs=lp), num_groups=groups)
    g = torch.Generator().manual_seed(17)
    noise = 0.05 * torch.randn(int(batch.response_lengths.sum()), generator=g)  # the engine's mismatch
    rollout_lp = backend.compute_log_probs(local) + dp_shard(replace(batch, advantages=noise), world, rank).advantages
    local = replace(local, rollout_log_probs=rollout_lp)
    ckpt = [tempfile.mkdtemp(prefix="fused_old_") if rank == 0 else None]
    torch.distributed.broadcast_object_list(ckpt, src=0)
    backend.save_checkpoint(ckpt[0], step=0)
    torch.distributed.barrier()  # rank 0 writes the step's meta file last (the loop commits after every rank)
    out = {}
    for case in (backend_name,):
        for fused in (False, True):
            backend.load_checkpoint(ckpt[0])
            actor.fuse_old_log_probs = fused
            plan = RankPlan(replace(local), [(0, local.num_samples)], [groups])
            assert (actor.separate_old_pass_reason(plan) is None) == fused
            forward_only.clear()
            reports = actor.train_rollout(plan).reports
            weights = backend.export_hf_state_dict()  # collective
            out[(case, fused)] = (reports, weights, len(forward_only))
    return out


@pytest.mark.parametrize("backend_name", ["fsdp", "megatron"])
def test_old_log_probs_from_training_forward_bitwise(run_world, tiny_qwen2, backend_name):
    hf_dir = tiny_qwen2
    results = run_world(_worker, 2, backend_name, hf_dir)
    for case in (backend_name,):
        for rank, out in enumerate(results):
            (sep, w_sep, n_sep), (fus, w_fus, n_fus) = out[(case, False)], out[(case, True)]
            assert (n_sep, n_fus) == (1, 0), "the fused path must skip the forward-only pass"
            a, b = sep[0], fus[0]
            assert set(a) == set(b), (case, set(a) ^ set(b))
            assert "mismatch/k3_kl" in a and "tis/weight_mean" in a and "ratio_mean" in a
            assert 0.0 < a["tis/clipped_frac"] < 1.0, (case, a["tis/clipped_frac"])  # the weights bite
            diff = {k: (a[k], b[k]) for k in a if k not in TIME_KEYS and a[k] != b[k]}
            assert not diff, (case, rank, diff)
            for name, w in w_sep.items():
                assert torch.equal(w, w_fus[name]), (case, name)


def test_rule_keeps_the_separate_pass_where_numbers_would_change():
    from rl_plugin.loss import LossConfig
    from rl_plugin.loss.runner import old_log_probs_rule
    from rl_plugin.parallel import ParallelState

    one = dict(
        step_bounds=[(0, 8)],
        num_samples=8,
        cfg=LossConfig(),
        ps=ParallelState.single(),
        has_rollout_log_probs=True,
        deterministic_forward=True,
    )
    assert old_log_probs_rule(**one) is None
    assert "2 optimizer steps" in old_log_probs_rule(**{**one, "step_bounds": [(0, 4), (4, 8)]})
    assert "optimizer steps" in old_log_probs_rule(**{**one, "step_bounds": [(0, 4)]})  # not the whole rollout
    assert "dropout" in old_log_probs_rule(**{**one, "deterministic_forward": False})
    custom = LossConfig(use_tis=True, custom_tis_function=lambda *a, **k: None)
    assert "custom-tis" in old_log_probs_rule(**{**one, "cfg": custom})
    cp2 = ParallelState(cp_size=2, cp_group=object(), dp_cp_group=object())
    assert "context parallelism" in old_log_probs_rule(**{**one, "ps": cp2})
    assert old_log_probs_rule(**{**one, "ps": cp2, "has_rollout_log_probs": False}) is None
