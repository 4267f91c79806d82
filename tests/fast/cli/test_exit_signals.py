"""Issue 28 #1, issue 38 #2: a preempted run saves and says how to resume (``--exit-signal-handler``).

Real processes: run S (embedded task, FSDP, one rank, ``--save-interval`` far away) gets SIGTERM
mid-train: its rank 0, about to run step 3 (rollout 2's only step), sends it to the driver
(``RL_PLUGIN_FAULT_SIGTERM_DRIVER_AT_STEP``) and waits for the stop request, as a preemption that
lands while the trainer works. The train call must stop before that step, the run write the
checkpoint of rollout 1 (step 2) holding rollout 2 as generated and not trained on, print the
last checkpoint and the resume command, release the output lock and exit 143, leaving no
process behind (it used to finish the whole rollout first). The printed command resumes it to the
end (trained on rollout 2 first), and the resumed run's metrics equal an uninterrupted run's line
for line; SIGTERM during the resumed run's teardown (after its last step) still ends it with 0,
the reward curve, the final lines and no lock (it used to exit 143 leaving the lock). Run R also
keeps its checkpoints with ``--save-retain`` / ``--save-retain-interval``, and a run resumed from
one of them with ``--ckpt-step`` equals R past that step. Stuck user code and the second signal:
``test_exit_signals_stuck.py``.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import time

import pytest

from rl_plugin.checkpoint.layout import complete_steps, latest_step
from rl_plugin.loop.exit_request import ExitRequest
from rl_plugin.ray.testing_hooks import SIGNAL_ENV
from tests.fast.cli.test_cli_faults import Proc, _gone, _names

NUM_ROLLOUT = 16  # rollouts take ~0.1 s here: the signal must land well before the last


def _argv(d, *extra):
    return [
        "--train-backend",
        "fsdp",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
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
    """Run S, SIGTERMed after its second step and resumed with the command it printed; run R,
    uninterrupted, saving every 4 rollouts with --save-retain 2 --save-retain-interval 8."""
    tmp = tmp_path_factory.mktemp("exit")
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # each run starts (and must end) its own local cluster
    env["RL_PLUGIN_CACHE"] = str(tmp / "cache")
    s_dir, r_dir = tmp / "s", tmp / "r"
    s = Proc(_argv(s_dir, "--save", str(s_dir / "ckpt"), "--save-interval", "100"), tmp, {**env, SIGNAL_ENV: "3"})
    try:
        s.wait_for(lambda: sum(ln.startswith("step ") for ln in s.out) >= 1, "run S's first step")
        tree = s.tree()
        rc = s.finish(timeout=300)
    finally:
        if s.p.poll() is None:
            os.killpg(s.p.pid, signal.SIGKILL)
    stopped = {"rc": rc, "err": "".join(s.err), "rows": _rows(s_dir / "out" / "metrics.jsonl"), "left": _gone(tree)}
    stopped["step"] = latest_step(s_dir / "ckpt")
    stopped["lock"] = (s_dir / "out" / ".rl_plugin.lock").exists()
    last = [ln for ln in stopped["err"].splitlines() if ln.strip()][-1]
    cmd = shlex.split(last.split(f"(last checkpoint: step {stopped['step']}): ", 1)[1])
    resumed = Proc(cmd[1:], tmp, env)
    retain = [
        "--save",
        str(r_dir / "ckpt"),
        "--save-interval",
        "4",
        "--save-retain",
        "2",
        "--save-retain-interval",
        "8",
    ]
    full = Proc(_argv(r_dir, *retain), tmp, env)
    # SIGTERM once the resumed run printed its last step: its final save or its teardown
    resumed.wait_for(lambda: any(ln.startswith(f"step {NUM_ROLLOUT} ") for ln in resumed.out), "the last step", 900)
    time.sleep(0.3)
    os.killpg(resumed.p.pid, signal.SIGTERM)
    late = {"rc": resumed.finish(timeout=900), "out": "".join(resumed.out), "err": "".join(resumed.err)}
    late["lock"] = (s_dir / "out" / ".rl_plugin.lock").exists()
    late["png"] = (s_dir / "out" / "reward_curve.png").exists()
    assert full.finish(timeout=900) == 0, "".join(full.err)[-3000:]
    return {"tmp": tmp, "env": env, "s_dir": s_dir, "r_dir": r_dir, "stopped": stopped, "last": last, "late": late}


def test_sigterm_mid_train_stops_before_the_next_step_and_saves_the_last_rollout(runs):
    st, s_dir, last = runs["stopped"], runs["s_dir"], runs["last"]
    assert st["rc"] == 128 + signal.SIGTERM, st["err"][-3000:]
    assert "received SIGTERM: stopping the rollout in progress, writing the last complete one's checkpoint" in st["err"]
    assert "Traceback" not in st["err"], st["err"][-3000:]
    rows, step = st["rows"], st["step"]
    assert step == rows[-1]["step"] == 2, (step, len(rows))  # step 3 was never run
    assert last.startswith(
        "stopped by SIGTERM during rollout 2: the train call stopped before its optimizer step 1 of 1; "
        "saved rollout 1 (step 2) with rollout 2, generated and not trained on yet."
    ), last
    assert f"resume with --load {s_dir / 'ckpt'} (last checkpoint: step 2): rl-plugin-train " in last, last
    assert not st["lock"], "the output lock outlived the run"
    assert not st["left"], f"left after SIGTERM: {_names(st['left'])}"


def test_sigterm_during_the_teardown_of_a_finished_run(runs):
    late = runs["late"]
    assert late["rc"] == 0, late["err"][-3000:]
    assert "rollout 2 was generated ahead before the checkpoint" in late["out"]  # resumed on the cut rollout
    assert "received SIGTERM" in late["err"] and "Traceback" not in late["err"], late["err"][-3000:]
    assert "reward curve: " in late["out"] and "the run finished; exit 0" in late["out"], late["out"][-2000:]
    assert late["png"] and not late["lock"]


def test_the_printed_command_resumes_to_the_uninterrupted_run(runs):
    assert _rows(runs["s_dir"] / "out" / "metrics.jsonl") == _rows(runs["r_dir"] / "out" / "metrics.jsonl")


def test_save_retain_keeps_the_newest_and_every_kth(runs):
    # saves after rollouts 4, 8, 12, 16 (one step each): newest two, plus the one after 8 rollouts
    assert complete_steps(runs["r_dir"] / "ckpt") == [8, 12, 16]


def test_ckpt_step_resumes_an_earlier_checkpoint_exactly(runs):
    r_dir, out = runs["r_dir"], runs["tmp"] / "from8"
    back = Proc(_argv(out, "--load", str(r_dir / "ckpt"), "--ckpt-step", "8"), runs["tmp"], runs["env"])
    assert back.finish(timeout=900) == 0, "".join(back.err)[-3000:]
    assert "resumed from " + str(r_dir / "ckpt" / "iter_0000008") in "".join(back.out)
    full = [r for r in _rows(r_dir / "out" / "metrics.jsonl") if r["step"] > 8]
    assert _rows(out / "out" / "metrics.jsonl") == full


def test_the_first_signal_is_recorded_and_runs_the_abort_actions_once():
    before = signal.getsignal(signal.SIGUSR1)
    req = ExitRequest(handle_signals=True, duration_mins=None, will_save=True, grace_s=600)
    asked = []
    req.actions = [lambda: asked.append(1) or "the reward f (rm(args, sample))", lambda: asked.append(2)]
    req.install()
    try:
        req.poll(can_abandon=True)
        assert req.reason() is None and asked == []
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler records it, never raises
        time.sleep(0.1)
        assert req.reason() == "stopped by SIGUSR1" and req.exit_code() == 128 + signal.SIGUSR1
        req.poll(can_abandon=True)
        req.poll(can_abandon=True)
        assert asked == [1, 2] and req.running() == ["the reward f (rm(args, sample))"]
    finally:
        req.restore()  # also cancels the grace watchdog
    assert signal.getsignal(signal.SIGUSR1) == before  # the caller's handler is back


def test_exit_duration_stops_with_exit_code_0():
    req = ExitRequest(handle_signals=False, duration_mins=0.5 / 60, will_save=False)
    assert req.reason() is None
    time.sleep(0.6)
    assert req.reason() == "stopped after --exit-duration-in-mins 0.00833333" and req.exit_code() == 0


def test_exit_flags_are_validated():
    from tests.support.flag_rules import assert_refused

    assert_refused("--exit-duration-in-mins 0", ["--exit-duration-in-mins", "positive", "Fix:"])
    assert_refused("--exit-signal-grace-s 0", ["--exit-signal-grace-s", "positive", "Fix:"])
    assert_refused("--save-retain 0", ["--save-retain", ">= 1"])
    assert_refused("--save-retain-interval 4", ["--save-retain-interval", "needs --save-retain"])
    assert_refused("--ckpt-step 8", ["--ckpt-step", "pass --load DIR"])
