"""The weight sync's flags (``rl_plugin.weight_sync.settings.SyncSettings``), read once into the run
config: defaults, slime's alias, the fingerprint derived from either check flag, the slots given
by the run's mode, and the two rules with their messages."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rl_plugin.arguments.embedded import parse_train_flags
from rl_plugin.configs.run import RunConfig
from rl_plugin.errors import RLArgumentError
from rl_plugin.weight_sync.settings import SyncSettings


def _run(*flags):
    return RunConfig.from_args(parse_train_flags(list(flags)))


def test_defaults_alias_and_the_derived_fingerprint():
    sync = _run().sync
    assert (sync.buffer_bytes, sync.transport, sync.check_weights, sync.fingerprint, sync.slots) == (
        512 * 1024**2,
        "auto",
        False,
        False,
        1,
    )
    alias = _run("--check-weight-update-equal", "--update-weight-buffer-size", "1024").sync  # slime's spelling
    assert (alias.check_weights, alias.fingerprint, alias.buffer_bytes) == (True, True, 1024)
    lora = _run("--lora-rank", "4", "--check-lora-weight-equal").sync  # the adapters are what travels
    assert (lora.check_weights, lora.fingerprint) == (False, True)
    assert _run("--max-weight-staleness", "1").sync.slots == 2  # v - 1 may load while v is published


def test_the_broadcast_is_refused_while_the_engines_generate_ahead():
    ahead = _run("--max-weight-staleness", "1")
    for transport in ("distributed", "nccl"):
        with pytest.raises(RLArgumentError) as err:
            replace(ahead.sync, transport=transport).check(ahead)
        assert str(err.value) == (
            f"--update-weight-transport {transport} with --max-weight-staleness 1: the broadcast needs the engines "
            "inside their load while the trainer publishes, and under overlapped training they are generating then: "
            "the trainer would wait for every generation. Fix: use --update-weight-transport auto (shared memory / "
            "object store) with --max-weight-staleness 1."
        )
    for transport in ("auto", "shared_memory", "object_store"):
        replace(ahead.sync, transport=transport).check(ahead)  # no rule
    in_step = _run()
    replace(in_step.sync, transport="distributed").check(in_step)  # synchronous: the engines wait in their load


def test_a_bucket_below_one_byte_is_refused():
    run = _run()
    with pytest.raises(RLArgumentError) as err:
        SyncSettings(buffer_bytes=0).check(run)
    assert str(err.value) == (
        "--update-weight-buffer-size: must be >= 1 byte (got 0). Fix: use e.g. 536870912 (512 MiB, slime's default)."
    )
    SyncSettings(buffer_bytes=1).check(run)
