"""Fully async (``--fully-async``) under a rollout-manager death, SIGTERM and resume, real processes
(``test_exit_signals.py``'s way). One run S (embedded task, FSDP, one rank, hf engine, K = 2):

- its rollout actor is SIGKILLed right after rollout 1's take is sent
  (``RL_PLUGIN_FAULT_KILL_ROLLOUT_AT``): a fresh manager gets the trainer's weights, starts its
  worker at version 1 and the take is retried, so rollout 1 is trained at staleness 0;
- it then gets SIGTERM as its rank 0 is about to run step 3 (rollout 2); it saves rollout 1 with
  rollout 2 taken and not trained on, and exits 143 naming the resume command.

The command resumes it: rollout 2 is trained on first, the buffer it had is dropped and its prompts
generated again (``async_requeue`` in the checkpoint's dataset state), and every row of both runs
has the ``async/*`` metrics within the staleness bound. (The manager's death and the SIGTERM were
two runs; one run carries both, each asserted as before.)"""

from __future__ import annotations

import json
import os
import shlex
import signal

from rl_plugin.checkpoint.layout import latest_step
from rl_plugin.ray.rollout_actor import FAULT_ENV
from rl_plugin.ray.testing_hooks import SIGNAL_ENV
from tests.fast.cli.test_cli_faults import Proc

NUM_ROLLOUT = 6
K = 2


def _argv(d, *extra):
    return [
        *("--train-backend", "fsdp", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4"),
        *("--num-rollout", str(NUM_ROLLOUT), "--output-dir", str(d / "out"), "--no-progress-bar"),
        *("--log-interval", "1", "--fully-async", "--max-weight-staleness", str(K), "--use-tis"),
        *extra,
    ]


def _rows(path):
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def test_a_killed_manager_restarts_then_sigterm_saves_and_the_resumed_run_trains_to_the_end(tmp_path):
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["RL_PLUGIN_CACHE"] = str(tmp_path / "cache")
    d = tmp_path / "s"
    faults = {SIGNAL_ENV: "3", FAULT_ENV: "1"}
    s = Proc(_argv(d, "--save", str(d / "ckpt"), "--save-interval", "100"), tmp_path, {**env, **faults})
    try:
        rc = s.finish(timeout=400)
    finally:
        if s.p.poll() is None:
            os.killpg(s.p.pid, signal.SIGKILL)
    out, err = "".join(s.out), "".join(s.err)
    assert rc == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    # the manager killed mid-take was restarted and the take retried
    assert "died during take (rollout 1)" in out and "restarting it and retrying (1/3" in out, out[-3000:]
    step = latest_step(d / "ckpt")
    assert step == 2, step
    last = [ln for ln in err.splitlines() if ln.strip()][-1]
    assert "rollout 2" in last, last
    cmd = shlex.split(last.split(f"(last checkpoint: step {step}): ", 1)[1])
    resumed = Proc(cmd[1:], tmp_path, env)
    rc2 = resumed.finish(timeout=600)
    out2, err2 = "".join(resumed.out), "".join(resumed.err)
    assert rc2 == 0, err2[-3000:]
    assert "rollout 2 was generated ahead before the checkpoint" in out2, out2[-2000:]
    rows = [r for r in _rows(d / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["rollout_id"] for r in rows] == list(range(NUM_ROLLOUT)), [r["rollout_id"] for r in rows]
    assert rows[1]["async/staleness_max"] == 0.0  # the fresh engines hold the trainer's weights: version 1
    for r in rows:
        assert 0 <= r["async/staleness_max"] <= K and r["async/staleness_mean"] <= r["async/staleness_max"]
        assert {"async/partial_frac", "async/buffer_groups", "async/trainer_wait_s", "async/dropped_stale"} <= set(r)
