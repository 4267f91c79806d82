"""The train group's typed calls (``rl_plugin.ray.train_group``, issue 43 item 3): the loop reaches
the ranks only through ``TrainGroup``'s methods, each naming the ``TrainActor`` method it
submits, so a reader (and the import graph) follows a call from the loop into
``ray/train_actor.py``. Static: no Ray (the end-to-end loop tests run these calls for real)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import rl_plugin
from rl_plugin.ray import train_group
from rl_plugin.ray.train_actor import TrainActor
from rl_plugin.ray.train_group import TrainGroup

ROOT = Path(rl_plugin.__file__).parent


def test_every_submitted_method_is_an_actor_method():
    """Each ``_submit(TrainActor.X, ...)`` names a public method of the actor, and every public
    proxy method submits one (``submit_X`` / ``X`` for the actor's ``X``)."""
    source = inspect.getsource(train_group)
    submitted = re.findall(r"_submit\(TrainActor\.(\w+)", source)
    assert sorted(set(submitted)) == [
        "compute_values",
        "eval_nll",
        "export_weight_buckets",
        "init",
        "load",
        "log_probs",
        "offload_train",
        "plan_docs_steps",
        "save",
        "save_hf",
        "train_rollout",
        "train_values_rollout",
    ]
    for name in submitted:
        assert inspect.isfunction(getattr(TrainActor, name, None)) and not name.startswith("_"), name
    proxies = {
        n.removeprefix("submit_")
        for n, f in vars(TrainGroup).items()
        if inspect.isfunction(f) and re.search(rf"TrainActor\.{n.removeprefix('submit_')}\b", f.__doc__ or "")
    }
    assert proxies == set(submitted) - {"init"}  # init: the group's constructor calls it


def test_no_string_named_call_reaches_the_train_group():
    """No ``call("method")`` on the group anywhere in the package, and the group has no such method."""
    assert not hasattr(TrainGroup, "call")
    offenders = []
    for path in ROOT.rglob("*.py"):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b(g|group|self\.group|train_group)\.call\(", line):
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, offenders


def test_train_rollout_publishes_only_when_asked():
    """The actor's one train call takes the publish decision as an argument and says in its answer
    whether it published (``TrainedRollout.handle``)."""
    params = inspect.signature(TrainActor.train_rollout).parameters
    # ray.remote(TrainActor) in this process (an earlier test) adds Ray's own ``_ray_trace_ctx``
    # to the class's methods in place: not part of the actor's interface
    assert [p for p in params if not p.startswith("_ray_")] == ["self", "plan", "publish"]
    assert params["publish"].default is None
    assert not hasattr(TrainActor, "train_rollout_and_sync")
    from rl_plugin.ray.train_actor import TrainedRollout

    assert TrainedRollout._fields == ("reports", "handle")
