"""True on-policy mode, hf engine + FSDP backend (issue 45): the trainer's ``compute_log_probs`` of
the engine's samples equals the engine's ``rollout_log_probs`` BITWISE (``torch.equal``), for a
batch of different prompt and response lengths at temperature 0.7, the engine on 1 thread and
the trainer on 2, on one rank (packed thd, and
padded bshd rows with micro-batches of 2) and on DP2 (real gloo processes), for a tiny Qwen2,
Llama with a tied head and Qwen3. Without the mode the same comparison is not bitwise (the
default kernels, ``F.linear`` on a handful of rows and sdpa, differ in the last bits), which is
what the mode removes.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.support.fsdp_common import fsdp_flags, parse

TEMPERATURE = 0.7
STOP = tuple(range(3, 23))  # ~1 in 6 tokens ends a response: lengths differ
PROMPT_LENGTHS = [3, 3, 3, 6, 6, 6, 11, 11, 11]  # three buckets of a prompt's three samples


def engine_samples(ckpt: str, *, true_on_policy: bool = True):
    """A StepBatch of the hf engine's samples (its rollout log-probs as old and rollout log-probs)."""
    from rl_plugin.loss import StepBatch
    from rl_plugin.rollout.engines.base import SamplingParams
    from rl_plugin.rollout.engines.hf_engine import HFEngine

    g = torch.Generator().manual_seed(0)
    prompts = []
    for i, n in enumerate(PROMPT_LENGTHS):
        if i % 3 == 0:
            prompt = torch.randint(3, 120, (n,), generator=g).tolist()
        prompts.append(prompt)
    engine = HFEngine(ckpt, true_on_policy=true_on_policy)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engine on 1 thread, the trainer ranks on 2 (``worker``)
    params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=12, stop_token_ids=STOP)
    try:
        gens = engine.generate(prompts, params, seed=3)
    finally:
        torch.set_num_threads(threads)
    tokens = torch.tensor([t for gen in gens for t in gen.prompt_ids + gen.response_ids])
    resp = torch.tensor([len(gen.response_ids) for gen in gens])
    rollout = torch.tensor([lp for gen in gens for lp in gen.log_probs], dtype=torch.float32)
    n = len(gens)
    return StepBatch(
        tokens=tokens,
        total_lengths=torch.tensor([len(gen.prompt_ids) for gen in gens]) + resp,
        response_lengths=resp,
        loss_mask=torch.ones(int(resp.sum())),
        advantages=torch.zeros(int(resp.sum())),
        group_ids=torch.arange(n) // 3,
        old_log_probs=rollout.clone(),
        rollout_log_probs=rollout,
    )


def trainer(ckpt: str, *extra: str, true_on_policy: bool = True):
    """An FSDP backend at the engine's temperature, ``TrainConfig.true_on_policy`` as given."""
    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from rl_plugin.configs.run import RunConfig

    flags = fsdp_flags(ckpt, "--rollout-temperature", str(TEMPERATURE), *extra)
    return FSDPBackend.from_config(
        dataclasses.replace(RunConfig.from_args(parse(flags)).train, true_on_policy=true_on_policy)
    )


LAYOUTS = {"thd": (), "bshd_mb2": ("--qkv-format", "bshd", "--micro-batch-size", "2")}
# DP2 splits the 9 samples 5/4; bshd with micro-batches of 2 would give rank 1 an idle bshd
# micro-batch, which the base code cannot build (``cp.local_inputs`` views 0 elements as [0, -1])
DP2_LAYOUTS = {"thd_mb1": ("--micro-batch-size", "1"), "bshd_mb3": ("--qkv-format", "bshd", "--micro-batch-size", "3")}
FAMILIES = {"qwen2": {}, "llama_tied": {"tie_word_embeddings": True}, "qwen3": {}}


def worker(rank, world, cases):
    """Each case ``(ckpt, batch, extra flags, mode)``: this rank's (log-probs, rollout log-probs)."""
    from rl_plugin.loss.micro_batch_plan import split_samples_for_dp

    torch.set_num_threads(2)
    out = []
    for ckpt, batch, extra, mode in cases:
        local = batch.select(split_samples_for_dp(batch.num_samples, world)[rank])
        backend = trainer(ckpt, *extra, true_on_policy=mode)
        out.append((backend.compute_log_probs(local), local.rollout_log_probs))
    # a training step through the patched model (autograd through every invariant op), after which
    # the log-probs move: the mode trains, it does not only score
    local.advantages = torch.linspace(-1, 1, local.advantages.numel())
    report = backend.train_step(local, num_groups=3)
    out.append((report, backend.compute_log_probs(local)))
    return out


@pytest.fixture(scope="module")
def samples(tiny_checkpoint):
    """Per family: (checkpoint, the engine's samples with the mode on)."""
    out = {}
    for name, config in FAMILIES.items():
        ckpt = tiny_checkpoint(name.split("_")[0], **config)
        out[name] = (ckpt, engine_samples(ckpt))
    return out


def _report(logp, rollout):
    return f"max |diff| {float((logp - rollout).abs().max()):.3e} over {logp.numel()} tokens"


def test_trainer_log_probs_equal_the_engines_bitwise_on_one_rank(samples, run_world):
    for _, batch in samples.values():
        assert len(set(batch.response_lengths.tolist())) > 1  # responses of different lengths
    # first the control: without the mode, the same comparison (default engine and trainer)
    ckpt = samples["qwen2"][0]
    cases = [(ckpt, engine_samples(ckpt, true_on_policy=False), (), False)]
    cases += [(ckpt, batch, extra, True) for ckpt, batch in samples.values() for extra in LAYOUTS.values()]
    names = [f"{family} {layout}" for family in samples for layout in LAYOUTS]
    results = run_world(worker, 1, cases)[0]
    (report, after), (control, control_rollout) = results.pop(), results.pop(0)
    assert 0 < float((control - control_rollout).abs().max()) < 1e-4, _report(control, control_rollout)
    for name, (logp, rollout) in zip(names, results):
        assert torch.equal(logp, rollout), f"{name}: {_report(logp, rollout)}"
    assert math.isfinite(report["loss"]) and report["grad_norm"] > 0, report
    assert float((after - results[-1][0]).abs().max()) > 1e-4  # the step changed the policy


def test_trainer_log_probs_equal_the_engines_bitwise_on_dp2(samples, run_world):
    ckpt, batch = samples["qwen2"]
    results = run_world(worker, 2, [(ckpt, batch, extra, True) for extra in DP2_LAYOUTS.values()])
    for rank in range(2):
        for layout, (logp, rollout) in zip(DP2_LAYOUTS, results[rank][:-1]):
            assert logp.numel() > 0 and torch.equal(logp, rollout), f"rank {rank} {layout}: {_report(logp, rollout)}"
