"""The value model trains the same step on both backends (issue 47).

The tiny Qwen2 as a critic HF directory with a random head (``tests.support.critic.value_checkpoint``:
a token-classification checkpoint, so both backends load the head as stored; a zero head would
leave the backbone's gradient at 0), and the critic tests' step data (masked middle segments,
one-token and zero-length responses, old values within +-0.3 of the returns so the clip cuts some
tokens). For every ``--loss-aggregation`` mode, one exact-SGD value step (lr 1: the update IS the
applied gradient) on FSDP (DP1), Megatron TP1 and Megatron TP2 (``critic.value_worker``) gives
the same forward-only values, ``value_loss``, ``vf_clipfrac``, ``grad_norm`` and update of every
weight by HF name (``score.weight`` included), and the loss, grad norm and values of the
unsharded HF reference (``critic.reference_value_step``), within ``tolerance.FP32_MODEL``.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.critic import MODES
from tests.support.tolerance import FP32_MODEL

TP2 = ("--tensor-model-parallel-size", "2")


@pytest.fixture(scope="module")
def results(run_world, tiny_qwen2, tmp_path_factory):
    from tests.support.critic import value_checkpoint, value_step_data, value_worker

    ckpt = value_checkpoint(tmp_path_factory.mktemp("value_xb"), str(tiny_qwen2))
    data = value_step_data(0)
    return (
        ckpt,
        data,
        {
            "fsdp": run_world(value_worker, 1, "fsdp", ckpt, data, MODES)[0],
            "megatron_tp1": run_world(value_worker, 1, "megatron", ckpt, data, MODES)[0],
            "megatron_tp2": run_world(
                value_worker, 2, "megatron", ckpt, data, {m: [*f, *TP2] for m, f in MODES.items()}
            )[0],
        },
    )


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def _update_rel(da, db):
    assert sorted(da) == sorted(db), sorted(set(da) ^ set(db))
    num = math.sqrt(sum(float(((da[k].double() - db[k].double()) ** 2).sum()) for k in db))
    return num / math.sqrt(sum(float((db[k].double() ** 2).sum()) for k in db))


@pytest.mark.parametrize("mode", list(MODES))
def test_megatron_value_step_is_fsdps(results, mode):
    _, _, out = results
    base = out["fsdp"][mode]
    for name in ("megatron_tp1", "megatron_tp2"):
        got = out[name][mode]
        vmax = float(base["values"].abs().max())
        assert torch.allclose(got["values"], base["values"], rtol=FP32_MODEL, atol=FP32_MODEL * vmax), name
        for key in ("value_loss", "grad_norm", "values_mean"):
            assert _rel(got["report"][key], base["report"][key]) < FP32_MODEL, (name, key, got["report"][key])
        assert got["report"]["vf_clipfrac"] == pytest.approx(base["report"]["vf_clipfrac"], abs=1e-6), name
        assert _update_rel(got["update"], base["update"]) < FP32_MODEL, (
            name,
            _update_rel(got["update"], base["update"]),
        )


@pytest.mark.parametrize("mode", list(MODES))
def test_megatron_value_step_matches_the_hf_reference(results, mode):
    from tests.support.critic import reference_value_step

    ckpt, data, out = results
    j, norm, values = reference_value_step(ckpt, data, mode)
    got = out["megatron_tp2"][mode]
    assert _rel(got["report"]["value_loss"], j) < FP32_MODEL, (got["report"]["value_loss"], j)
    assert _rel(got["report"]["grad_norm"], norm) < FP32_MODEL, (got["report"]["grad_norm"], norm)
    assert torch.allclose(got["values"].double(), values, rtol=FP32_MODEL, atol=FP32_MODEL * float(values.abs().max()))
    assert float(got["update"]["score.weight"].abs().max()) > 1e-4
