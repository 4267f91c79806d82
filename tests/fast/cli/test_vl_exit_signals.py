"""Issue 46: a preempted vision-language run saves, with its images, and the printed command resumes it.

The colour task (``tests/support/tiny_vl``: FSDP, the hf engine, one image per prompt) run as
``test_exit_signals`` runs the text task: rank 0, about to run step 3 (rollout 2's only step),
SIGTERMs the driver (``RL_PLUGIN_FAULT_SIGTERM_DRIVER_AT_STEP``). The run must save the checkpoint
of rollout 1 (step 2) holding rollout 2, generated and not trained on: its ``pending_rollout.pt``
carries every sample's pixels and grid (``RolloutData.pixel_values`` / ``image_grid_thw`` /
``image_counts``) and the model files the vision tower's weights and AdamW moments. The command it
prints resumes it to the end, trained on the saved rollout 2 first, and the resumed run's metrics
equal an uninterrupted run's line for line (a rollout whose images were lost would train on other
numbers, or fail). A VL checkpoint at another DP size: ``backends/fsdp/test_vision_checkpoint.py``.
"""

from __future__ import annotations

import json
import os
import shlex
import signal

import pytest
import torch

from rl_plugin.checkpoint.layout import latest_step, step_dir
from rl_plugin.checkpoint.pending_rollout import read_pending_rollout
from rl_plugin.ray.testing_hooks import SIGNAL_ENV
from rl_plugin.rollout.data.vl_task import write_colour_task
from tests.fast.cli.test_cli_faults import Proc, _gone, _names
from tests.support.tiny_vl import COLOUR_TASK_FLAGS, tiny_vl_dir

NUM_ROLLOUT = 6
PROMPTS, SAMPLES = 4, 4


def _argv(model, data, d, *extra):
    return [
        "--train-backend",
        "fsdp",
        "--hf-checkpoint",
        str(model),
        "--prompt-data",
        str(data),
        *COLOUR_TASK_FLAGS,
        "--rollout-batch-size",
        str(PROMPTS),
        "--n-samples-per-prompt",
        str(SAMPLES),
        "--rollout-max-response-len",
        "1",
        "--global-batch-size",
        str(PROMPTS * SAMPLES),
        "--micro-batch-size",
        "8",
        "--lr",
        "3e-3",
        "--num-rollout",
        str(NUM_ROLLOUT),
        "--output-dir",
        str(d / "out"),
        "--no-progress-bar",
        "--log-interval",
        "1",
        *extra,
    ]


def _rows(path):
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run S, SIGTERMed before its third step, then resumed with the command it printed; run R,
    the same run uninterrupted."""
    tmp = tmp_path_factory.mktemp("vl_exit")
    model = tiny_vl_dir(tmp)
    data, _ = write_colour_task(tmp / "task", num_train=64, num_eval=4, num_colours=2)
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # each run starts (and must end) its own local cluster
    env["RL_PLUGIN_CACHE"] = str(tmp / "cache")
    s_dir, r_dir = tmp / "s", tmp / "r"
    s = Proc(
        _argv(model, data, s_dir, "--save", str(s_dir / "ckpt"), "--save-interval", "100"),
        tmp,
        {**env, SIGNAL_ENV: "3"},
    )
    try:
        s.wait_for(lambda: sum(ln.startswith("step ") for ln in s.out) >= 1, "run S's first step", 600)
        tree = s.tree()
        rc = s.finish(timeout=300)
    finally:
        if s.p.poll() is None:
            os.killpg(s.p.pid, signal.SIGKILL)
    stopped = {"rc": rc, "err": "".join(s.err), "left": _gone(tree), "step": latest_step(s_dir / "ckpt")}
    stopped["rows"] = _rows(s_dir / "out" / "metrics.jsonl")
    last = [ln for ln in stopped["err"].splitlines() if ln.strip()][-1]
    cmd = shlex.split(last.split(f"(last checkpoint: step {stopped['step']}): ", 1)[1])
    resumed = Proc(cmd[1:], tmp, env)
    full = Proc(_argv(model, data, r_dir), tmp, env)  # beside it: two local clusters
    back = {"rc": resumed.finish(timeout=900), "out": "".join(resumed.out), "err": "".join(resumed.err)}
    assert full.finish(timeout=900) == 0, "".join(full.err)[-3000:]
    return {"s_dir": s_dir, "r_dir": r_dir, "stopped": stopped, "last": last, "back": back}


def test_sigterm_saves_the_last_rollout_and_the_rollout_generated_ahead(runs):
    st, s_dir, last = runs["stopped"], runs["s_dir"], runs["last"]
    assert st["rc"] == 128 + signal.SIGTERM, st["err"][-3000:]
    assert "Traceback" not in st["err"], st["err"][-3000:]
    assert st["step"] == st["rows"][-1]["step"] == 2
    assert last.startswith(
        "stopped by SIGTERM during rollout 2: the train call stopped before its optimizer step 1 of 1; "
        "saved rollout 1 (step 2) with rollout 2, generated and not trained on yet."
    ), last
    assert "--multimodal-keys" in last and f"--load {s_dir / 'ckpt'}" in last
    assert not st["left"], f"left after SIGTERM: {_names(st['left'])}"


def test_the_saved_rollout_carries_its_images(runs):
    pending = read_pending_rollout(runs["s_dir"] / "ckpt", 2)
    data, n = pending.data, PROMPTS * SAMPLES
    assert pending.rollout_id == 2 and data.total_lengths.numel() == n
    assert data.image_counts.tolist() == [1] * n
    assert data.image_grid_thw.shape == (n, 3)
    patches = int(data.image_grid_thw.prod(dim=1).sum())
    assert data.pixel_values.shape[0] == patches and data.pixel_values.shape[1] > 0
    assert float(data.pixel_values.abs().sum()) > 0  # real pixels, not a blank placeholder


def test_the_checkpoint_holds_the_vision_tower(runs):
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(step_dir(runs["s_dir"] / "ckpt", 2)).read_metadata().state_dict_metadata
    vision = [k for k in keys if ".visual." in k]
    assert any("exp_avg" in k for k in vision) and any("exp_avg" not in k for k in vision), sorted(keys)[:20]


def test_the_printed_command_resumes_to_the_uninterrupted_run(runs):
    back = runs["back"]
    assert back["rc"] == 0, back["err"][-3000:]
    assert "rollout 2 was generated ahead before the checkpoint" in back["out"]
    got = _rows(runs["s_dir"] / "out" / "metrics.jsonl")
    want = _rows(runs["r_dir"] / "out" / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, NUM_ROLLOUT + 1))
    assert got == want
    assert torch.tensor([r["reward_mean"] for r in got]).isfinite().all()
