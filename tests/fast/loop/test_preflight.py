"""The run's first-second checks (``rl_plugin.loop.preflight``) that are its own: a finished run,
the reward server probe, the user functions loaded before Ray starts, and the note on changed
settings only for a resume. (The file checks it calls: ``tests/fast/arguments``; the whole
preflight from the command line: ``tests/fast/cli``.)"""

from __future__ import annotations

import socket

import pytest

from rl_plugin.arguments.embedded import parse_train_flags
from rl_plugin.configs.run import RunConfig
from rl_plugin.errors import RLArgumentError
from rl_plugin.loop.preflight import (
    check_reward_server,
    check_user_functions,
    finished_message,
    is_finished,
    note_changed_settings,
)


def _run(*flags):
    return RunConfig.from_args(parse_train_flags(list(flags)))


def test_a_checkpoint_past_the_last_rollout_is_a_finished_run():
    run = _run("--num-rollout", "4", "--load", "/ckpt")
    assert is_finished(run, 4) and not is_finished(run, 3) and not is_finished(run, None)
    assert finished_message(run, 8) == (
        "--load /ckpt: the run is complete: its checkpoint (step 8) has done all 4 rollouts of --num-rollout 4, so "
        "there is nothing to train. To train further, raise --num-rollout (it counts all rollouts of the run, "
        "e.g. --num-rollout 8)"
    )


def test_a_reward_server_that_is_down_is_named_before_ray_starts():
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/rm"
    with pytest.raises(RLArgumentError) as err:
        check_reward_server(url)
    assert str(err.value) == (
        f"--rm-url {url}: the reward server is not reachable (cannot connect to 127.0.0.1:{port}: Connection refused; "
        "probed for 5 s before starting Ray). Fix: start the reward server first, or correct the host and port of --rm-url."
    )
    with socket.socket() as server:  # something accepts connections there: no error
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        check_reward_server(f"http://127.0.0.1:{server.getsockname()[1]}/rm")


def test_each_user_function_loads_before_ray_starts(tmp_path):
    hooks = tmp_path / "hooks.py"
    hooks.write_text("def reducer(*args):\n    return args\n\n\ndef other():\n    pass\n")
    check_user_functions(_run("--custom-pg-loss-reducer-function-path", f"{hooks}:reducer"))  # loads: fine
    with pytest.raises(RLArgumentError) as err:
        check_user_functions(_run("--custom-generate-function-path", f"{hooks}:generate"))
    assert str(err.value) == (
        f"--custom-generate-function-path: cannot load the function '{hooks}:generate': '{hooks}' has no callable "
        "'generate'; it defines: reducer, other. Fix: correct the name after the ':' (or define that function in "
        "the module)."
    )


def test_no_note_without_a_resume_point(capsys):
    note_changed_settings(_run(), None)
    assert capsys.readouterr().err == ""
