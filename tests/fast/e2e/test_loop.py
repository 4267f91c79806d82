"""The RL loop end to end on CPU: real Ray actors, gloo groups (DP=2), HF generate, both backends.

One local Ray cluster serves every run of this module (starting Ray is the slow part). Per
backend, run A is uninterrupted (3 rollouts x 2 optimizer steps, checkpoint every rollout,
--check-weight-sync, eval). Then:

- FSDP: run B kills train rank 1 (SIGKILL) as it starts step 3; the driver must name rank 1 and
  say it died. Run C resumes with --load; B's lines + C's lines must equal A's metrics file byte
  for byte: no completed step lost, the resumed trajectory identical, same seed same metrics.
- Megatron: resume from the step-2 checkpoint of run A; steps 3.. must equal A's.
- Across backends: the same seed gives the same first rollout and the same step-1 loss and grad
  norm (within ``tolerance.FP32_MODEL``, against the magnitude of the log-probs and advantages).
- Rollout engine faults: the rollout actor SIGKILLed mid-rollout is restarted and the Megatron run
  ends byte-identical to A; past --max-rollout-retries the run stops naming engine, cause, --load.
"""

import json
import os
import shutil
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from rl_plugin.checkpoint.commit import write_tracker  # noqa: E402
from rl_plugin.checkpoint.layout import latest_step  # noqa: E402
from rl_plugin.loop.embedded_setup import ensure_tiny_model  # noqa: E402
from rl_plugin.ray.rollout_actor import FAULT_ENV as ROLLOUT_FAULT_ENV  # noqa: E402
from rl_plugin.ray.testing_hooks import FAULT_ENV  # noqa: E402
from rl_plugin.train import main  # noqa: E402
from tests.support.local_ray import local_ray_cluster  # noqa: E402
from tests.support.tolerance import FP32_MODEL, FP64, within  # noqa: E402

FLAGS = [
    "--rollout-batch-size",
    "4",
    "--n-samples-per-prompt",
    "4",
    "--global-batch-size",
    "8",
    "--micro-batch-size",
    "2",
    "--num-rollout",
    "3",
    "--actor-num-gpus-per-node",
    "2",
    "--eval-interval",
    "2",
    "--check-weight-sync",
    "--save-interval",
    "1",
    "--no-progress-bar",
    "--lr",
    "1e-3",
]


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    with local_ray_cluster(tmp_path_factory.mktemp("cache")):
        yield


def _run(backend, out, *extra):
    return main(["--train-backend", backend, "--output-dir", str(out), "--save", str(out / "ckpt"), *FLAGS, *extra])


def _lines(path):
    return [json.loads(x) for x in open(path).read().splitlines()]


def _log_scale(row) -> float:
    """Magnitude of the step's log-probs: the mean |log-prob| (the metric is the sample mean of
    the old log-probs), the scale of the rounding in a mean of log-prob terms."""
    return max(1.0, abs(row["old_log_prob"]))


def _same_first_step(a, b) -> None:
    """Two fp32 runs of one step in another layout/backend: the loss terms are -A * r with
    r = exp(logp - old), so their rounding is bounded by FP32_MODEL * max|A| * |logp|."""
    scale = max(abs(b["advantage_max"]), abs(b["advantage_min"])) * _log_scale(b)
    for key in ("loss", "pg_loss"):
        assert within(a[key], b[key], rtol=FP32_MODEL, scale=scale), (key, a[key], b[key])
    assert within(a["grad_norm"], b["grad_norm"], rtol=FP32_MODEL), ("grad_norm", a["grad_norm"], b["grad_norm"])
    assert within(a["old_log_prob"], b["old_log_prob"], rtol=FP32_MODEL), (
        "old_log_prob",
        a["old_log_prob"],
        b["old_log_prob"],
    )


@pytest.fixture(scope="module")
def runs_a(ray_cluster, tmp_path_factory):
    out = {}
    for backend in ("fsdp", "megatron"):
        d = tmp_path_factory.mktemp(f"a_{backend}")
        assert _run(backend, d) == 0
        out[backend] = d
    return out


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_run_writes_metrics_checkpoints_and_plot(runs_a, backend):
    d = runs_a[backend]
    rows = _lines(d / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert [r["rollout_id"] for r in train] == [0, 0, 1, 1, 2, 2]
    assert [r["samples_seen"] for r in train] == [8.0 * s for s in range(1, 7)]  # docs/design.md: samples seen so far
    assert [(r["rollout_id"], r["step"]) for r in evals] == [(1, 4), (2, 6)]
    for r in train:
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["samples"] == 8.0 and r["grad_norm"] > 0
        # trainer and sampler compute the same log-probs: the mean |old - rollout| is fp32 rounding of
        # two forwards (HF generate with a KV cache, the trainer's packed forward) of |logp| terms
        assert r["rollout_log_prob_diff"] < FP32_MODEL * _log_scale(r)
    # on-policy at the first step: ratio = exp(logp - old) of two fp32 forwards of the same weights
    assert within(train[0]["ratio_mean"], 1.0, rtol=FP32_MODEL, scale=_log_scale(train[0]))
    assert latest_step(d / "ckpt") == 6
    assert (d / "reward_curve.png").stat().st_size > 1000
    timings = _lines(d / "metrics.timings.jsonl")
    assert len(timings) == 6 and all(t["time/train_step"] > 0 for t in timings)
    per_rollout = [t for t in timings if "time/rollout_call" in t]  # issue 16 #13: reward timed apart from generation
    assert len(per_rollout) == 3
    for t in per_rollout:
        assert t["time/rollout_generate"] > 0 and t["time/rollout_reward"] > 0
        assert t["time/rollout_generate"] + t["time/rollout_reward"] <= t["time/rollout_call"]
    # the weight sync rides on the loop's calls: every train call publishes (a later generate or eval
    # loads it), and each rollout logs the engine loads answered since the previous one: none before
    # rollout 0, generate(1) loading rollout 0's weights, the eval after rollout 1 loading rollout 1's
    assert all(t["time/weight_publish"] > 0 for t in per_rollout)
    assert [t["time/weight_load_engines"] > 0 for t in per_rollout] == [False, True, True]
    assert all(t["time/weight_sync"] == t["time/weight_publish"] + t["time/weight_load_engines"] for t in per_rollout)


# The checkpoint layout the loop owns (docs/design.md "Checkpoints"): the tracker and one complete
# iter_* directory per save, each holding the backend's files directly (nothing nested, no staging
# left behind). DCP names one shard file per rank (__<rank>_0.distcp); both runs have 2 ranks.
CHECKPOINT_FILES = {
    "fsdp": [".metadata", "__0_0.distcp", "__1_0.distcp", "loop_state.json", "meta.pt", "rng_rank0.pt", "rng_rank1.pt"],
    "megatron": [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "common.pt",
        "loop_state.json",
        "metadata.json",
        "rng_rank0.pt",
        "rng_rank1.pt",
    ],
}


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_checkpoint_layout_on_disk(runs_a, backend):
    root = runs_a[backend] / "ckpt"
    saved = (2, 4, 6)  # --save-interval 1: after every rollout, 2 steps each
    assert sorted(p.name for p in root.iterdir()) == [f"iter_{s:07d}" for s in saved] + [
        "latest_checkpointed_iteration.txt"
    ]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "6\n"
    for s in saved:
        assert sorted(p.name for p in (root / f"iter_{s:07d}").iterdir()) == CHECKPOINT_FILES[backend], s
    state = json.loads((root / "iter_0000006" / "loop_state.json").read_text())
    assert (state["step"], state["next_rollout"], state["train_backend"]) == (6, 3, backend)


def test_same_seed_other_backend_same_first_step(runs_a):
    f = [r for r in _lines(runs_a["fsdp"] / "metrics.jsonl") if "loss" in r][0]
    m = [r for r in _lines(runs_a["megatron"] / "metrics.jsonl") if "loss" in r][0]
    for key in ("reward_mean", "reward_max", "response_len_mean", "tokens", "advantage_max", "advantage_min"):
        assert f[key] == m[key], key  # identical rollout
    _same_first_step(m, f)


def test_killed_actor_is_named_and_resume_loses_no_step(runs_a, tmp_path, monkeypatch, capsys):
    d = tmp_path / "b"
    monkeypatch.setenv(FAULT_ENV, "1:3")
    assert _run("fsdp", d) == 1
    err = capsys.readouterr().err
    assert "train actor rank 1" in err and "died during train_rollout" in err, err
    assert f"resume with --load {d / 'ckpt'} (last checkpoint: step 2)" in err
    assert [r["step"] for r in _lines(d / "metrics.jsonl")] == [1, 2]
    monkeypatch.delenv(FAULT_ENV)
    assert _run("fsdp", d, "--load", str(d / "ckpt")) == 0
    assert (d / "metrics.jsonl").read_text() == (runs_a["fsdp"] / "metrics.jsonl").read_text()


def test_megatron_resume_continues_identically(runs_a, tmp_path):
    d = tmp_path / "c"
    shutil.copytree(runs_a["megatron"] / "ckpt", d / "ckpt")
    write_tracker(d / "ckpt", 2)  # resume from after rollout 0
    assert _run("megatron", d, "--load", str(d / "ckpt")) == 0
    resumed = [r for r in _lines(d / "metrics.jsonl")]
    full = [r for r in _lines(runs_a["megatron"] / "metrics.jsonl") if r["step"] > 2]
    assert resumed == full


def test_megatron_resume_on_another_layout(runs_a, tmp_path):
    """A's DP=2 checkpoint after rollout 0, resumed at TP=2 x DP=1 (dist_checkpointing reshards):
    the loaded weights are A's bitwise, so rollout 1 is A's exactly (samples, rewards, tokens,
    advantages), and its two steps agree with A's within FP32_MODEL (tests/support/tolerance.py;
    the loss and the policy loss against the advantages' magnitude, its terms; the grad norm and
    the old log-probs relative: nothing cancels in them); the TP-sharded weights export and sync
    (--check-weight-sync) to the rollout. (Same seed, other layout: this also was a separate fresh
    TP=2 run's first step against A's; the fresh TP=2 build from the HF checkpoint is
    ``tests/fast/backends/megatron/test_parity.py``'s, against TP=1 and the HF reference.)"""
    d = tmp_path / "relayout"
    shutil.copytree(runs_a["megatron"] / "ckpt", d / "ckpt")
    write_tracker(d / "ckpt", 2)
    assert (
        _run("megatron", d, "--load", str(d / "ckpt"), "--tensor-model-parallel-size", "2", "--num-rollout", "2") == 0
    )
    resumed = [r for r in _lines(d / "metrics.jsonl") if "loss" in r]
    full = [r for r in _lines(runs_a["megatron"] / "metrics.jsonl") if "loss" in r and r["step"] > 2]
    assert [r["step"] for r in resumed] == [3, 4]
    for got, want in zip(resumed, full[:2]):  # rollout 1: generated from the loaded weights
        keys = ("reward_mean", "reward_max", "response_len_mean", "tokens", "samples_seen", "lr")
        for key in keys + ("advantage_max", "advantage_min"):
            assert got[key] == want[key], key
        _same_first_step(got, want)  # loss, pg_loss, grad norm, old log-probs


def test_docs_per_step_kl_colocate_tensorboard(ray_cluster, tmp_path):
    """--docs-per-step (steps planned by the train actors, collective over DP), --use-kl-loss
    (reference log-probs), --colocate placement and TensorBoard, on the Megatron backend; with
    --use-rollout-logprobs the engine's log-probs are the old ones (no recompute pass), so the
    mismatch is exactly 0 and the step-1 ratio is 1 up to the engine/trainer fp32 difference."""
    flags = [
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--micro-batch-size",
        "2",
        "--docs-per-step",
        "6",
        "--num-rollout",
        "1",
        "--actor-num-gpus-per-node",
        "2",
        "--colocate",
        "--use-kl-loss",
        "--kl-loss-coef",
        "0.1",
        "--tensorboard-dir",
        str(tmp_path / "tb"),
        "--no-progress-bar",
        "--check-weight-sync",
        "--use-rollout-logprobs",
    ]
    assert main(["--train-backend", "megatron", "--output-dir", str(tmp_path), *flags]) == 0
    rows = [r for r in _lines(tmp_path / "metrics.jsonl") if "loss" in r]
    # 16 samples, 8 per DP rank in micro-batches of 2: rounds of 4 documents, a step closes at >= 6
    assert [r["samples"] for r in rows] == [8.0, 8.0]
    # policy == reference at the first step: low_var_kl of two fp32 forwards of the same weights,
    # log-ratios d ~ FP32_MODEL * |logp|, kl ~ d^2 / 2 <= d
    assert abs(rows[0]["kl_loss"]) <= FP32_MODEL * _log_scale(rows[0])
    assert rows[1]["kl_loss"] > 0  # the first step moved the policy away from the reference
    assert [r["num_documents"] for r in rows] == [8.0, 8.0] and [r["documents_seen"] for r in rows] == [8.0, 16.0]
    assert rows[0]["mismatch/abs_diff_mean"] == 0.0 and rows[0]["mismatch/k3_kl"] == 0.0  # old IS the engine's
    # old = the engine's log-probs: the ratio is exp of the train-inference rounding gap
    assert within(rows[0]["ratio_mean"], 1.0, rtol=FP32_MODEL, scale=_log_scale(rows[0]))
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_bad_prompt_file_is_named(ray_cluster, tmp_path, capsys):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "12=", "label": "12"}\n{oops\n')
    argv = [
        "--train-backend",
        "fsdp",
        "--prompt-data",
        str(data),
        "--rollout-batch-size",
        "1",
        "--rollout-max-response-len",
        "4",
        "--num-rollout",
        "1",
        "--rm-type",
        "digit_match",
        "--output-dir",
        str(tmp_path / "o"),
        "--no-progress-bar",
    ]
    assert main(argv) == 2  # no --hf-checkpoint: caught before Ray starts
    model = str(ensure_tiny_model(Path(os.environ["RL_PLUGIN_CACHE"])))
    assert main(argv + ["--hf-checkpoint", model]) == 2  # issue 16: the whole file is read before Ray starts
    err = capsys.readouterr().err
    assert f"--prompt-data: {data}:2: not valid JSON" in err, err


def test_bad_reward_names_the_sample(ray_cluster, tmp_path, capsys):
    """A custom reward returning NaN stops the run at the first rollout, naming the sample."""
    rm = tmp_path / "rm.py"
    rm.write_text("def reward(prompt, response, label):\n    return float('nan') if prompt.startswith('9') else 0.5\n")
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "12=", "label": "12"}\n{"prompt": "93=", "label": "93"}\n')
    model = str(ensure_tiny_model(Path(os.environ["RL_PLUGIN_CACHE"])))
    argv = [
        "--train-backend",
        "fsdp",
        "--hf-checkpoint",
        model,
        "--prompt-data",
        str(data),
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--rollout-max-response-len",
        "3",
        "--num-rollout",
        "1",
        "--custom-rm-path",
        f"{rm}:reward",
        "--output-dir",
        str(tmp_path / "o"),
        "--no-progress-bar",
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert (
        "rollout manager failed during generate: ValueError: reward function returned nan for sample 2 (prompt '93=', response"
        in err
    ), err


def test_killed_rollout_engine_is_restarted_and_the_run_continues_identically(runs_a, tmp_path, monkeypatch, capsys):
    """The rollout actor's process is SIGKILLed while it generates rollout 1: the driver starts a
    fresh one, loads the trainer's current weights into it (checked: --check-weight-sync) and
    the dataset position, and retries; the metrics equal the uninterrupted run's byte for byte.
    On Megatron, so this is also the backend's determinism check (two runs, same seed and flags,
    byte-identical metrics files; FSDP's is the kill-and-resume test above)."""
    d = tmp_path / "engine"
    monkeypatch.setenv(ROLLOUT_FAULT_ENV, "1")
    assert _run("megatron", d, "--num-rollout", "2") == 0  # A's first two rollouts (and the eval after rollout 1)
    out = capsys.readouterr().out
    assert "the rollout engine (hf, in the rollout manager actor) died during generate (rollout 1)" in out, out
    assert "restarting it and retrying (1/3, --max-rollout-retries)" in out
    lines = (d / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert len(lines) == 5 and lines == (runs_a["megatron"] / "metrics.jsonl").read_text().splitlines(keepends=True)[:5]


def test_rollout_engine_dying_past_the_retry_limit_names_engine_cause_and_load(
    ray_cluster, tmp_path, monkeypatch, capsys
):
    d = tmp_path / "engine_limit"
    monkeypatch.setenv(ROLLOUT_FAULT_ENV, "1,1")  # rollout 1 and its retry
    assert _run("fsdp", d, "--max-rollout-retries", "1", "--num-rollout", "2") == 1
    err = capsys.readouterr().err
    assert "the rollout engine (hf, in the rollout manager actor) died during generate (rollout 1)" in err, err
    assert "It was restarted 1 time(s) already (--max-rollout-retries 1)" in err
    assert f"resume with --load {d / 'ckpt'} (last checkpoint: step 2)" in err
    assert [r["step"] for r in _lines(d / "metrics.jsonl")] == [1, 2]  # what was logged is kept


def test_perturbed_engine_tis_and_dynamic_sampling(ray_cluster, tmp_path):
    """An engine whose log-probs disagree with the trainer by d = 0.5 per token
    (--debug-rollout-logprob-shift): the mismatch metrics, reduced over every DP rank, read |d| and
    K3 = e^d - 1 - d; the TIS weight e^0.5 = 1.65 is truncated to --tis-clip 1.5 on every token.
    Dynamic sampling over-samples 8 prompts a round and trains only the 4 groups whose rewards
    vary; its counts match the step's samples and groups. Tolerance: the engine and the trainer
    compute the same fp32 log-probs up to rounding, FP32_MODEL * |logp| (the runs above); K3's
    slope at d = 0.5 is e^0.5 - 1 < 1, so the same bound holds for it."""
    import math

    d = tmp_path / "tis"
    flags = [
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--micro-batch-size",
        "4",
        "--num-rollout",
        "2",
        "--actor-num-gpus-per-node",
        "2",
        "--no-progress-bar",
        "--use-tis",
        "--tis-clip",
        "1.5",
        "--debug-rollout-logprob-shift",
        "0.5",
        "--over-sampling-batch-size",
        "8",
        "--dynamic-sampling-filter-path",
        "rl_plugin.rollout.dapo.filters.check_reward_nonzero_std",
        "--overlong-buffer-len",
        "2",
        "--deepspeed-metric-names",
    ]
    assert main(["--train-backend", "fsdp", "--output-dir", str(d), *flags]) == 0
    rows = [r for r in _lines(d / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 2
    for r in rows:
        gap = FP32_MODEL * _log_scale(r)
        assert abs(r["mismatch/abs_diff_mean"] - 0.5) <= gap and abs(r["mismatch/abs_diff_max"] - 0.5) <= gap
        assert abs(r["mismatch/k3_kl"] - (math.exp(0.5) - 1.5)) <= gap
        assert (
            within(r["tis/weight_mean"], 1.5, rtol=FP64) and r["tis/clipped_frac"] == 1.0
        )  # every weight clipped to 1.5
        assert r["dynamic_sampling/groups_kept"] == 4.0 and r["groups"] == 4.0 and r["samples"] == 16.0
        assert r["dynamic_sampling/groups_generated"] >= r["dynamic_sampling/groups_passed"] >= 4.0
        assert r["dynamic_sampling/groups_generated"] == 8.0 * r["dynamic_sampling/rounds"]
        assert r["ratio_new_old"] == r["ratio_mean"] and r["num_tokens"] == r["tokens"]
    # old log-probs are the trainer's, not the shifted ones
    assert within(rows[0]["ratio_mean"], 1.0, rtol=FP32_MODEL, scale=_log_scale(rows[0]))


def test_resume_supersedes_the_rows_written_after_the_checkpoint(ray_cluster, tmp_path, monkeypatch, capsys):
    """Issue 16 #4: a run checkpoints at step 4, logs steps 5-6, dies at step 7. The resumed run
    trains steps 5.. again: the file must read as one run (each step once, in order), and the
    interrupted run's rows 5-6 are kept in metrics.superseded.jsonl, equal to the re-run ones
    (same seed, same flags)."""
    d = tmp_path / "s"
    one_rank = ["--actor-num-gpus-per-node", "1", "--save-interval", "2", "--num-rollout", "4"]
    monkeypatch.setenv(FAULT_ENV, "0:7")
    assert _run("fsdp", d, *one_rank) == 1
    assert latest_step(d / "ckpt") == 4
    assert [r["step"] for r in _lines(d / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4, 5, 6]
    monkeypatch.delenv(FAULT_ENV)
    capsys.readouterr()
    assert _run("fsdp", d, *one_rank, "--load", str(d / "ckpt")) == 0
    assert "steps 5-6 were written after the checkpoint" in capsys.readouterr().out
    rows = _lines(d / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [(r["rollout_id"], r["step"]) for r in rows if "eval/reward_mean" in r] == [(1, 4), (3, 8)]
    superseded = _lines(d / "metrics.superseded.jsonl")
    assert [r.pop("superseded_by_resume_from") for r in superseded] == [4, 4]
    assert superseded == [r for r in rows if r["step"] in (5, 6)]


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_load_of_another_model_size_names_the_first_tensor(runs_a, tmp_path, backend, capsys):
    """Issue 16 #9: a checkpoint of the tiny model loaded into a wider one: one line naming the
    checkpoint, the model, the first mismatching tensor and the fix (was: 17 size-mismatch lines)."""
    from rl_plugin.loop.embedded_setup import MODEL
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint
    from rl_plugin.rollout.data.tokenizer import FILENAME

    cfg = {k: v for k, v in MODEL.items() if k != "family"}
    wide = make_tiny_hf_checkpoint(tmp_path / "wide", MODEL["family"], **{**cfg, "hidden_size": 96})
    shutil.copy(ensure_tiny_model(Path(os.environ["RL_PLUGIN_CACHE"])) / FILENAME, wide / FILENAME)
    ckpt = runs_a[backend] / "ckpt"
    assert _run(backend, tmp_path / "o", "--load", str(ckpt), "--hf-checkpoint", str(wide), "--num-rollout", "4") == 2
    err = capsys.readouterr().err
    assert f"--load {ckpt}/iter_0000006" in err and f"holds another model than --hf-checkpoint {wide}" in err, err
    assert (
        "(64,) in the checkpoint and (96,) in the model" in err or "in the checkpoint and (16, 96) in the model" in err
    ), err
    assert "Fix: pass the --hf-checkpoint the checkpoint was trained from" in err
    assert "Traceback" not in err and err.count("size mismatch") == 0


def _without_staleness(lines):
    rows = [json.loads(x) for x in lines]
    for r in rows:
        r.pop("weight_staleness", None)
    return rows


def test_overlapped_run_retries_in_flight_generation_and_resumes_exactly(runs_a, tmp_path, monkeypatch, capsys):
    """--max-weight-staleness 1 (FSDP), the rollout actor SIGKILLed as rollout 1 is submitted to
    it, i.e. while the trainer trains on rollout 0:

    - rollout 0 is generated in place by the initial weights: its steps equal sync run A's byte for
      byte (only weight_staleness is added);
    - the in-flight generation of rollout 1 fails after training; the fresh engine gets the
      trainer's current weights and regenerates it, so rollout 1 is sampled by the weights after
      rollout 0 (staleness 0) and equals A's rollout 1 (and A's eval after it) byte for byte;
    - rollout 2 is generated while the trainer trains on rollout 1, by the weights after rollout 0
      (staleness 1): the engine's log-probs now describe an older policy, so |old - rollout| is
      far above the fp32 rounding the synchronous run shows (FP32_MODEL * |logp|);
    - the step-2 checkpoint holds rollout 1 (pending_rollout.pt); a run resumed from it trains on
      it, generates rollout 2 ahead, and logs A-async's steps 3.. byte for byte."""
    d = tmp_path / "overlap"
    monkeypatch.setenv(ROLLOUT_FAULT_ENV, "1")
    assert _run("fsdp", d, "--max-weight-staleness", "1") == 0
    out, err = capsys.readouterr()
    assert "warning: --max-weight-staleness 1 without --use-tis" in err
    assert "died during generate (rollout 1)" in out and "restarting it and retrying (1/3" in out, out
    lines = (d / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    train = [r for r in rows if "loss" in r]
    assert [(r["rollout_id"], r["weight_staleness"]) for r in train] == [
        (0, 0.0),
        (0, 0.0),
        (1, 0.0),
        (1, 0.0),
        (2, 1.0),
        (2, 1.0),
    ]
    sync = (runs_a["fsdp"] / "metrics.jsonl").read_text().splitlines()
    assert _without_staleness(lines[:5]) == _without_staleness(sync[:5])  # steps 1-4 and the eval after rollout 1
    for r in train[4:]:
        assert r["rollout_log_prob_diff"] > 100 * FP32_MODEL * _log_scale(r), r["rollout_log_prob_diff"]
    timings = [t for t in _lines(d / "metrics.timings.jsonl") if "time/rollout_total" in t]
    assert [("time/generate_ahead" in t, "time/trainer_wait_generate" in t) for t in timings] == [
        (True, True),
        (True, True),
        (False, True),
    ]
    assert all(
        t["time/generate_ahead"] > 0 and t["time/engine_wait_trainer"] >= 0 and t["time/overlap_saved"] >= 0
        for t in timings[:2]
    )
    assert all(t["time/weight_publish"] > 0 for t in timings)  # each train call published (double-buffered)
    assert [(d / "ckpt" / f"iter_{s:07d}" / "pending_rollout.pt").is_file() for s in (2, 4, 6)] == [True, True, False]

    monkeypatch.delenv(ROLLOUT_FAULT_ENV)
    r = tmp_path / "overlap_resumed"
    shutil.copytree(d / "ckpt", r / "ckpt")
    write_tracker(r / "ckpt", 2)
    assert _run("fsdp", r, "--max-weight-staleness", "1", "--load", str(r / "ckpt")) == 0
    assert (r / "metrics.jsonl").read_text().splitlines() == [x for x in lines if json.loads(x)["step"] > 2]
    assert (
        "rollout 1 was generated ahead before the checkpoint and is trained on as it was (staleness 0)"
        in capsys.readouterr().out
    )
