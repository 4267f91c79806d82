"""An MoE model's checkpoints at expert parallelism 2: ``--save`` / ``--load`` resumes the trained
weights bit for bit (megatron-core dist checkpointing of the sequential experts; the chained
optimizer's ``chained_<i>.`` state keys are optimizer entries, not model tensors), ``--save-hf``
writes every expert exactly as the export has it, and a resume at another expert parallelism
(one optimizer instead of megatron-core's two) is refused naming the flag."""

from __future__ import annotations

import pytest
import torch


def _worker(rank, world, hf_dir, root):
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from rl_plugin.backends.megatron.checkpoint import CheckpointFormatError
    from tests.support.megatron_common import dp_shard, make_args, synthetic_batch, with_old_log_probs

    def build(ep):
        flags = ("--hf-checkpoint", hf_dir, "--expert-model-parallel-size", str(ep), "--lr", "1e-2")
        return MegatronBackend.from_args(make_args(*flags, world_size=world))

    backend = build(2)
    batch, num_groups = synthetic_batch(seed=3, num_prompts=2, n_per_prompt=2, old_noise=0.3)
    ps = backend.parallel_state
    local = dp_shard(batch, ps.dp_size, ps.dp_rank)
    backend.train_step(with_old_log_probs(local, backend.compute_log_probs(local)), num_groups=num_groups)
    backend.save_checkpoint(f"{root}/ckpt", step=1)
    backend.save_hf(f"{root}/hf")
    trained = backend.export_hf_state_dict()
    again = build(2)
    again.load_checkpoint(f"{root}/ckpt")
    resumed = again.export_hf_state_dict()
    try:
        build(1).load_checkpoint(f"{root}/ckpt")
        refusal = None
    except CheckpointFormatError as exc:
        refusal = str(exc)
    return (trained, resumed, refusal) if rank == 0 else refusal


@pytest.fixture(scope="module")
def saved(run_world, tmp_path_factory):
    from rl_plugin.models.tiny import make_tiny_moe_checkpoint

    root = tmp_path_factory.mktemp("moe_ckpt")
    hf_dir = str(make_tiny_moe_checkpoint(root / "model", "qwen3_moe", seed=4))
    (trained, resumed, refusal), refusal1 = run_world(_worker, 2, hf_dir, str(root))
    return hf_dir, root, trained, resumed, [refusal, refusal1]


def test_resume_and_save_hf_at_ep2_are_exact(saved):
    from safetensors.torch import load_file

    hf_dir, root, trained, resumed, _ = saved
    initial = load_file(f"{hf_dir}/model.safetensors")
    assert any(not torch.equal(trained[k], initial[k]) for k in initial if ".experts." in k)  # experts trained
    assert sorted(resumed) == sorted(trained)
    assert all(torch.equal(resumed[k], trained[k]) for k in trained)
    written = {}
    for f in sorted((root / "hf").glob("*.safetensors")):
        written.update(load_file(str(f)))
    assert sorted(written) == sorted(trained)
    assert all(torch.equal(written[k], trained[k]) for k in trained)


def test_resume_at_another_expert_parallelism_is_refused(saved):
    messages = saved[4]
    assert all(m is not None and "--expert-model-parallel-size" in m for m in messages), messages
