"""Issue 37 item 2: ``--offload-train`` moves the training state to host memory and back bitwise.

One gloo rank per backend (Megatron, FSDP2), the tiny Qwen2, Adam (its moments exist after the
first rollout). Run A: train on rollout 1, offload (every storage of the state shrinks to 0 bytes),
train on rollout 2 (the train call reloads first). Run B, from the same start: rollout 1, rollout 2,
no offload. The state right after the reload equals the state before the offload byte for byte, and
rollout 2's reports, gradients and updated weights are bitwise run B's. On a CPU the "device" is
host memory: the copies and frees run all the same (what the GPU adds: pinned copies, the memory
returned to the driver, ``tests/gpu``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch


def _snapshot(backend):
    seen, out = set(), []
    for t in backend.state_tensors():
        t = t._local_tensor if hasattr(t, "_local_tensor") else t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key not in seen:
            seen.add(key)
            out.append(t.detach().clone())
    return out


def _worker(rank, world, hf_dir, backend_name):
    from rl_plugin.arguments import parse_args
    from rl_plugin.configs import TrainConfig
    from rl_plugin.ray.train_actor import TrainActor, backend_class
    from rl_plugin.step_plan import RankPlan
    from tests.support.megatron_common import synthetic_batch

    flags = ["--train-backend", backend_name, "--hf-checkpoint", hf_dir, "--lr", "0.01", "--optimizer", "adam"]
    config = TrainConfig.from_args(parse_args(flags + ["--use-kl-loss", "--kl-loss-coef", "0.1"]))
    backend = backend_class(backend_name).from_config(config)
    actor = TrainActor(rank, world)
    actor.config, actor.backend = config, backend
    rollouts = [synthetic_batch(seed=s, num_prompts=2, n_per_prompt=2) for s in (1, 2)]
    plan = [RankPlan(replace(b), [(0, b.num_samples)], [g]) for b, g in rollouts]
    params = list(backend.model.parameters())
    start = [p.detach().clone() for p in params]
    schedule = backend.scheduler.state_dict() if hasattr(backend, "scheduler") else None
    out = {}
    for name in ("offload", "plain"):
        with torch.no_grad():
            for p, p0 in zip(params, start):
                p.copy_(p0)
        for opt in getattr(backend.optimizer, "chained_optimizers", [backend.optimizer]):
            getattr(opt, "optimizer", opt).state.clear()
        if schedule is not None:
            backend.scheduler.load_state_dict(schedule)
        actor.train_rollout(replace(plan[0], batch=replace(rollouts[0][0])))
        if name == "offload":
            before = _snapshot(backend)
            moved = actor.offload_train()
            emptied = all(t.untyped_storage().nbytes() == 0 for t in _locals(backend) if t.numel())
            assert actor.offload_train() == 0  # once per generation: a second call does nothing
            actor._onload()
            after = _snapshot(backend)
            same = len(before) == len(after) and all(
                a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
                for a, b in zip(before, after)
            )
            actor.offload_train()  # offloaded again: the train call below reloads it
            out["round_trip"] = (moved, emptied, same, len(before))
        reports = actor.train_rollout(replace(plan[1], batch=replace(rollouts[1][0]))).reports
        grads = {
            n: (getattr(p, "main_grad", None) if p.grad is None else p.grad)
            for n, p in backend.model.named_parameters()
        }
        grads = {n: g.detach().clone() for n, g in grads.items() if g is not None}
        out[name] = (reports, grads, {k: v.clone() for k, v in backend.export_hf_state_dict().items()})
    return out


def _locals(backend):
    for t in backend.state_tensors():
        t = t._local_tensor if hasattr(t, "_local_tensor") else t
        if t.untyped_storage().resizable():
            yield t


@pytest.mark.parametrize("backend_name", ["megatron", "fsdp"])
def test_offload_round_trip_is_bitwise_and_training_continues_identically(run_world, tiny_qwen2, backend_name):
    out = run_world(_worker, 1, tiny_qwen2, backend_name)[0]
    moved, emptied, same, tensors = out["round_trip"]
    assert moved > 0 and tensors > 10
    assert emptied, "a state tensor kept its memory while offloaded"
    assert same, "the state after the reload differs from the state before the offload"
    (ra, ga, wa), (rb, gb, wb) = out["offload"], out["plain"]
    for a, b in zip(ra, rb):
        diff = {k: (a[k], b[k]) for k in a if not k.startswith("time/") and a[k] != b[k]}
        assert not diff, diff
    assert ga.keys() == gb.keys() and (ga or backend_name == "fsdp")  # FSDP frees its grads after the step
    for n in ga:
        assert torch.equal(ga[n], gb[n]), n
    for n in wa:
        assert torch.equal(wa[n], wb[n]), n
