"""Per-phase wall time of one rollout's trainer work on the embedded task (tiny Qwen2, CPU, gloo).

One training process (world size 1, ``RL_PLUGIN_TRAIN_THREADS`` threads as in the Ray actor), the
embedded run's flags and batch shape (16 prompts x 8 samples, prompt ``<bos> d d d <sep>``,
response <= 4 tokens, one micro-batch of 128), the backend driven as ``TrainActor.train_rollout``
drives it: old log-probs (forward only), one ``train_step``, then the weight export of a sync.
The train step is split by wrapping the functions it calls with ``time.perf_counter`` timers
(inclusive times; ``schedule`` is what megatron's forward-backward function spends outside the
forward, loss, backward and grad finalisation it calls; ``other`` is the step minus its parts).
Medians over ``--steps`` steps after ``--warmup``; the spread is the inter-quartile range.

    python -m benchmarks.step_phases [--backend megatron|fsdp] [--steps 30] [--cprofile FILE] [--json F]
    python -m benchmarks.step_phases --compare 'before-*.json' 'after-*.json'   # table of two sets

Not a test: numbers depend on the machine and its load. Run ``before`` and ``after`` checkouts
alternately to compare (``--label``), and read the IQR as the noise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from statistics import median, quantiles


class Timers:
    """Inclusive wall time per label, accumulated per step; ``wrap`` patches ``owner.name``."""

    def __init__(self):
        self.now = defaultdict(float)
        self.steps = defaultdict(list)
        self.patched = []

    def wrap(self, owner, name: str, label: str) -> bool:
        orig = getattr(owner, name, None)
        if orig is None:
            return False
        acc = self.now

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                acc[label] += time.perf_counter() - t0

        setattr(owner, name, timed)
        self.patched.append((owner, name, orig))
        return True

    def add(self, label: str, seconds: float) -> None:
        self.now[label] += seconds

    def end_step(self) -> None:
        for k, v in self.now.items():
            self.steps[k].append(v)
        self.now.clear()


def embedded_batch(seed: int = 0, prompts: int = 16, n: int = 8, digits: int = 3, max_resp: int = 4):
    """A step batch shaped like the embedded run's: ``<bos> d.. <sep>`` then up to ``max_resp``
    sampled tokens (the last one ``<eos>`` when shorter)."""
    import torch

    from rl_plugin.loss import StepBatch

    g = torch.Generator().manual_seed(seed)
    samples = prompts * n
    prompt = torch.cat(
        [
            torch.ones(prompts, 1, dtype=torch.long),
            torch.randint(4, 14, (prompts, digits), generator=g),
            torch.full((prompts, 1), 3, dtype=torch.long),
        ],
        1,
    ).repeat_interleave(n, 0)
    resp_len = torch.randint(max_resp - 1, max_resp + 1, (samples,), generator=g)
    resp = torch.randint(4, 14, (samples, max_resp), generator=g)
    tokens = torch.cat([torch.cat([prompt[i], resp[i, : int(resp_len[i])]]) for i in range(samples)])
    adv = torch.repeat_interleave(torch.randn(samples, generator=g), resp_len)
    r = int(resp_len.sum())
    batch = StepBatch(
        tokens=tokens,
        total_lengths=resp_len + prompt.shape[1],
        response_lengths=resp_len,
        loss_mask=torch.ones(r),
        advantages=adv,
        group_ids=torch.arange(prompts).repeat_interleave(n),
        rollout_log_probs=-2.0 + 0.1 * torch.randn(r, generator=g),
    )
    return batch.validate(), prompts


def instrument(timers: Timers, backend_name: str, backend) -> None:
    import rl_plugin.loss.runner as runner_mod
    import rl_plugin.loss.step as loss_step

    timers.wrap(loss_step.StepContext, "micro_batch", "step/micro_batch")
    timers.wrap(loss_step.StepContext, "loss", "step/loss")
    timers.wrap(loss_step.StepContext, "finish", "step/finish_metrics")
    if backend_name == "megatron":
        import megatron.core.pipeline_parallel.schedules as sched

        import rl_plugin.backends.megatron.step as mstep

        timers.wrap(runner_mod, "prepare_step", "step/prepare_step")
        timers.wrap(mstep, "response_log_probs", "step/forward")
        timers.wrap(runner_mod.StepRunner, "plan", "step/plan")
        timers.wrap(sched, "backward_step", "step/backward")
        timers.wrap(sched, "forward_backward_no_pipelining", "step/forward_backward_func")
        cfg = backend.bridge.config
        timers.wrap(cfg, "finalize_model_grads_func", "step/finalize_model_grads")
        timers.wrap(backend.model, "zero_grad_buffer", "step/zero_grad")
        opt = backend.optimizer
        timers.wrap(opt, "zero_grad", "step/zero_grad")
        timers.wrap(opt, "step", "step/optimizer_step")
        for o in getattr(opt, "chained_optimizers", [opt]):
            timers.wrap(o, "prepare_grads", "opt/prepare_grads")
            timers.wrap(o, "clip_grad_norm", "opt/clip_grad_norm")
            timers.wrap(o, "step_with_ready_grads", "opt/step_with_ready_grads")
            timers.wrap(o.optimizer, "step", "opt/torch_adam")
        timers.wrap(backend.scheduler, "step", "step/scheduler")
    else:
        import rl_plugin.backends.fsdp.backend as fb

        timers.wrap(runner_mod, "prepare_step", "step/prepare_step")
        timers.wrap(fb, "micro_batch_log_probs", "step/forward")
        timers.wrap(runner_mod.StepRunner, "plan", "step/plan")
        timers.wrap(fb, "all_reduce", "step/num_passes_allreduce")  # the schedule's MAX over DP
        timers.wrap(fb, "clip_grad_norm", "step/clip_grad_norm")
        timers.wrap(backend.optimizer, "step", "step/optimizer_step")
        timers.wrap(backend.optimizer, "zero_grad", "step/zero_grad")
        timers.wrap(fb, "set_lr", "step/scheduler")
        import torch

        orig_backward = torch.Tensor.backward

        def backward(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return orig_backward(self, *a, **k)
            finally:
                timers.add("step/backward", time.perf_counter() - t0)

        torch.Tensor.backward = backward


TOP_LEVEL = {
    "megatron": (
        "step/plan",
        "step/prepare_step",
        "step/zero_grad",
        "step/forward_backward_func",
        "step/optimizer_step",
        "step/scheduler",
        "step/finish_metrics",
    ),
    "fsdp": (
        "step/plan",
        "step/prepare_step",
        "step/num_passes_allreduce",
        "step/micro_batch",
        "step/forward",
        "step/loss",
        "step/backward",
        "step/clip_grad_norm",
        "step/optimizer_step",
        "step/zero_grad",
        "step/scheduler",
        "step/finish_metrics",
    ),
}
IN_SCHEDULE = ("step/micro_batch", "step/forward", "step/loss", "step/backward", "step/finalize_model_grads")


def run(a) -> dict:
    import torch
    import torch.distributed as dist

    from rl_plugin.arguments.embedded import parse_train_flags
    from rl_plugin.configs import TrainConfig
    from rl_plugin.loop.embedded_setup import cache_root, ensure_tiny_model
    from rl_plugin.ray.train_actor import TrainActor
    from rl_plugin.step_plan import RankPlan

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    hf_dir = str(ensure_tiny_model(cache_root()))
    args = parse_train_flags(["--train-backend", a.backend, "--hf-checkpoint", hf_dir, *a.extra])
    actor = TrainActor(0, 1)  # sets the thread count the Ray actor uses
    actor.init(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), TrainConfig.from_args(args))
    backend = actor.backend
    batch, groups = embedded_batch()
    timers = Timers()
    instrument(timers, a.backend, backend)
    compute_log_probs = backend.compute_log_probs

    def untimed_log_probs(*args, **kwargs):  # its forward is rollout/old_log_probs, not step/forward
        saved = dict(timers.now)
        try:
            return compute_log_probs(*args, **kwargs)
        finally:
            timers.now.clear()
            timers.now.update(saved)

    backend.compute_log_probs = untimed_log_probs
    prof = None
    if a.cprofile:
        import cProfile

        prof = cProfile.Profile()
    for i in range(a.warmup + a.steps):
        b = batch.select(torch.arange(batch.num_samples))
        if prof is not None and i == a.warmup:
            prof.enable()
        t0 = time.perf_counter()
        reports = actor.train_rollout(RankPlan(b, [(0, b.num_samples)], [groups])).reports
        t1 = time.perf_counter()
        backend.export_hf_state_dict()
        t2 = time.perf_counter()
        timers.add("rollout/train_rollout", t1 - t0)
        timers.add("rollout/old_log_probs", reports[0]["time/log_probs"])
        timers.add("rollout/train_step", reports[0]["time/train_step"])
        timers.add("rollout/export_weights", t2 - t1)
        if i >= a.warmup:
            timers.end_step()
        else:
            timers.now.clear()
    if prof is not None:
        prof.disable()
        prof.dump_stats(a.cprofile)
    actor.shutdown()
    return {"steps": dict(timers.steps), "threads": torch.get_num_threads(), "dist": dist.is_available()}


def summarize(steps: dict, backend: str) -> dict:
    rows = {}
    for k, v in steps.items():
        q = quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
        rows[k] = (median(v), q[2] - q[0])
    n = len(next(iter(steps.values())))

    def med_of(fn):
        return median(fn(i) for i in range(n))

    get = lambda k, i: steps.get(k, [0.0] * n)[i]  # noqa: E731
    if backend == "megatron":
        rows["step/schedule_overhead"] = (
            med_of(lambda i: get("step/forward_backward_func", i) - sum(get(k, i) for k in IN_SCHEDULE)),
            0.0,
        )
    rows["step/other"] = (
        med_of(lambda i: get("rollout/train_step", i) - sum(get(k, i) for k in TOP_LEVEL[backend])),
        0.0,
    )
    return rows


def compare(before_glob: str, after_glob: str) -> None:
    """Before/after table from ``--json`` files (alternating runs): the median over all steps of a
    side, the ratio, and each run's own median (their spread is the machine's noise)."""
    import glob

    sides = {
        name: [json.load(open(f))["steps"] for f in sorted(glob.glob(pattern))]
        for name, pattern in (("before", before_glob), ("after", after_glob))
    }
    keys = sorted({k for runs in sides.values() for run in runs for k in run})
    print(f"{'phase (ms, median)':34} {'before':>8} {'after':>8} {'ratio':>6}   per-run medians: before | after")
    for k in keys:
        med, per_run = {}, {}
        for name, runs in sides.items():
            pooled = [x for run in runs for x in run.get(k, [])]
            med[name] = 1000 * median(pooled) if pooled else float("nan")
            per_run[name] = " ".join(f"{1000 * median(run[k]):.1f}" for run in runs if k in run)
        ratio = med["after"] / med["before"] if med["before"] > 0 else float("nan")
        print(
            f"{k:34} {med['before']:8.2f} {med['after']:8.2f} {ratio:6.2f}   {per_run['before']} | {per_run['after']}"
        )


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--compare":
        compare(sys.argv[2], sys.argv[3])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="megatron", choices=["megatron", "fsdp"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--label", default="")
    p.add_argument("--cprofile", help="also write cProfile stats of the timed steps to this file")
    p.add_argument("--json", help="write the per-step times to this file")
    a, a.extra = p.parse_known_args()
    res = run(a)
    rows = summarize(res["steps"], a.backend)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f)
    print(f"{a.label} {a.backend}: median of {a.steps} rollouts, {res['threads']} torch thread(s); ms (IQR)")
    for k in sorted(rows):
        med, iqr = rows[k]
        print(f"  {k:34} {1000 * med:8.2f} ({1000 * iqr:6.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
