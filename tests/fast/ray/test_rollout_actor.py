"""The rollout manager's actor helpers (``rl_plugin.ray.rollout_actor``): the ``SomeError:
message`` line picked out of Ray's wrapped remote traceback (what the driver's errors quote), and
the fault-injection test hook's list of rollouts. (The actor itself, started on Ray: the e2e and
cli suites.)"""

from __future__ import annotations

from rl_plugin.ray.rollout_actor import FAULT_ENV, error_line, fault_points

RAY_WRAPPED = """ray::RolloutManager.__init__() (pid=4242, ip=10.0.0.1, actor_id=abc)
  File "/work/rl_plugin/rollout/manager.py", line 80, in __init__
    self.dataset = PromptDataset(prompt_data)
  File "/work/rl_plugin/rollout/data/dataset.py", line 40, in __init__
    raise ValueError(f"{path}:3: not JSON")
ValueError: --prompt-data /data/p.jsonl:3: not JSON (Expecting value: line 1 column 1 (char 0))

During handling, Ray wrapped it: RayTaskError(ValueError)
"""


def test_the_last_error_line_of_a_remote_traceback_is_picked():
    assert error_line(RuntimeError(RAY_WRAPPED)) == (
        "ValueError: --prompt-data /data/p.jsonl:3: not JSON (Expecting value: line 1 column 1 (char 0))"
    )  # "During handling, Ray wrapped it: ..." has a space before its colon: not an error line
    nested = "ray::x\nrl_plugin.rollout.rewards.functions.RewardFunctionError: rm.py:7: boom\n"
    assert error_line(RuntimeError(nested)) == "rl_plugin.rollout.rewards.functions.RewardFunctionError: rm.py:7: boom"
    assert (
        error_line(RuntimeError("KeyboardInterrupt\n  the engine stopped\n")) == "the engine stopped"
    )  # no error line
    assert error_line(RuntimeError("")) == "RuntimeError"


def test_the_fault_hook_lists_the_rollouts_to_kill_at(monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    assert fault_points() == []
    monkeypatch.setenv(FAULT_ENV, "3, 1,3,")  # a rollout listed twice: its retry is killed too
    assert fault_points() == [3, 1, 3]
