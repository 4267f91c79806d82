"""The log-prob part (``rl_plugin.loss_config.logprobs``): bshd's padded length is ``--seq-length``
(thd has none), and the temperature must be finite and > 0."""

from __future__ import annotations

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.errors import RLArgumentError
from rl_plugin.loss_config import LossConfig


def _cfg(*flags):
    return LossConfig.from_args(parse_args(list(flags)))


def test_max_seq_len_is_bshds_padded_length_only():
    assert _cfg("--qkv-format", "bshd", "--seq-length", "96").max_seq_len == 96
    assert _cfg("--seq-length", "96").max_seq_len is None  # thd packs: no padded length
    cfg = _cfg("--rollout-temperature", "0.7", "--log-probs-chunk-size", "256")
    assert (cfg.temperature, cfg.logprob_chunk_size) == (0.7, 256)


@pytest.mark.parametrize("value, shown", [("0", "0.0"), ("-1", "-1.0"), ("nan", "nan"), ("inf", "inf")])
def test_temperature_must_be_finite_and_positive(value, shown):
    with pytest.raises(RLArgumentError) as err:
        parse_args(["--rollout-temperature", value])
    assert str(err.value) == (
        f"--rollout-temperature: must be a finite number > 0 (got {shown}). Fix: use the sampler's temperature, e.g. 1.0."
    )
