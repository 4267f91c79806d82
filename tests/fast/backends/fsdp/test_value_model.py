"""The FSDP backend's value model (``TrainConfig.value_head``; ``backends/fsdp/value_model.py``),
real FSDP2 on gloo, tiny Qwen2, fp32.

From a causal-LM checkpoint the critic is the backbone with a ZERO scalar head ``score`` (every
value 0, the LM head gone); one value step then moves only the head (the backbone's gradient is
``score`` times something: 0). Its AdamW state and step counter are checkpointed: reloading the
step-1 checkpoint and repeating step 2 gives the same report and weights, bit for bit, and a DP2
checkpoint resumes on DP1 with the same weights and next step. ``--save-hf``
writes a ``Qwen2ForTokenClassification`` directory with one label whose values, each sample run
alone through transformers, equal the backend's packed values. A value model refuses the policy's
passes and a policy the critic's.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.critic import (
    VALUE_CLIP,
    alone_values,
    value_backend,
    value_checkpoint,
    value_flags,
    value_step_data,
)
from tests.support.fsdp_common import step_batch
from tests.support.tolerance import FP32_MODEL, tensor_within

ADAM = ["--optimizer", "adam", "--lr", "0.05", "--adam-eps", "1e-2"]


def _worker(rank, world, lm_dir, root):
    b = value_backend(value_flags(lm_dir, *ADAM))
    batch = step_batch(value_step_data(0))
    out = dict(names=sorted(b.export_hf_state_dict()), score0=b.export_hf_state_dict()["score.weight"])
    out["values0"] = b.compute_values(batch)
    w0 = b.export_hf_state_dict()
    out["report1"] = b.value_train_step(batch, num_groups=3, value_clip=VALUE_CLIP)
    w1 = b.export_hf_state_dict()
    out["moved1"] = sorted(k for k in w0 if not torch.equal(w0[k], w1[k]))
    b.save_checkpoint(f"{root}/ckpt", step=1)
    out["report2"] = b.value_train_step(batch, num_groups=3, value_clip=VALUE_CLIP)
    w2 = b.export_hf_state_dict()
    out["moved2"] = sum(1 for k in w1 if not torch.equal(w1[k], w2[k]))
    b.load_checkpoint(f"{root}/ckpt")
    out["report2_resumed"] = b.value_train_step(batch, num_groups=3, value_clip=VALUE_CLIP)
    out["same_weights"] = all(torch.equal(v, b.export_hf_state_dict()[k]) for k, v in w2.items())
    out["values2"] = b.compute_values(batch)
    b.save_hf(f"{root}/hf")
    errors = []
    for call in (lambda: b.compute_log_probs(batch), lambda: b.train_step(batch, num_groups=3)):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    out["errors"] = errors
    return out


def _policy_worker(rank, world, lm_dir):
    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from tests.support.fsdp_common import parse

    b = FSDPBackend.from_args(parse(value_flags(lm_dir)))
    try:
        b.compute_values(step_batch(value_step_data(0)))
    except ValueError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def run(run_world, tiny_qwen2, tmp_path_factory):
    root = tmp_path_factory.mktemp("value_model")
    return run_world(_worker, 1, tiny_qwen2, str(root))[0], root, tiny_qwen2


def test_a_fresh_critic_is_the_backbone_with_a_zero_head(run):
    out, _, lm_dir = run
    from safetensors.torch import load_file

    lm = load_file(f"{lm_dir}/model.safetensors")
    assert out["names"] == sorted([k for k in lm if k.startswith("model.")] + ["score.weight"])
    assert out["score0"].shape == (1, 32) and float(out["score0"].abs().max()) == 0.0
    assert out["values0"].dtype == torch.float32 and float(out["values0"].abs().max()) == 0.0
    assert out["values0"].shape == (int(step_batch(value_step_data(0)).response_lengths.sum()),)


def test_the_first_step_moves_the_head_only_and_reports_the_zero_prediction_loss(run):
    out, _, _ = run
    assert out["moved1"] == ["score.weight"]  # d/dtheta of score . h(theta) is 0 while score is 0
    batch = step_batch(value_step_data(0))
    m, ret = batch.loss_mask.double(), batch.returns.double()
    old = batch.values.double()
    vc = old + (0.0 - old).clamp(-VALUE_CLIP, VALUE_CLIP)  # v' = 0: the clipped prediction
    per_token = 0.5 * torch.maximum(ret**2, (vc - ret) ** 2)
    from tests.support import reference as ref

    j = float(ref.objective(per_token, m, batch.response_lengths.tolist(), batch.group_ids, "sample_mean"))
    r1 = out["report1"]
    assert abs(r1["value_loss"] - j) <= FP32_MODEL * max(1.0, float(ret.abs().max()) ** 2), (r1["value_loss"], j)
    assert r1["values_mean"] == 0.0 and r1["grad_norm"] > 1e-3 and r1["lr"] == 0.05
    assert out["moved2"] > 10  # the second step moves the backbone too


def test_resume_gives_the_same_next_step(run):
    out, _, _ = run
    assert out["report2_resumed"] == out["report2"]
    assert out["same_weights"]


def test_the_hf_export_loads_as_token_classification_with_the_backends_values(run):
    out, root, _ = run
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = json.loads((root / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForTokenClassification"] and config["token_classification_bias"] is False
    assert AutoConfig.from_pretrained(str(root / "hf")).num_labels == 1  # stored as a one-entry id2label
    assert (root / "hf" / "generation_config.json").is_file()  # the source's other files come along
    model = AutoModelForTokenClassification.from_pretrained(str(root / "hf"), dtype=torch.float32).eval()
    assert model.score.bias is None
    with torch.no_grad():
        hf_values = alone_values(model, step_batch(value_step_data(0)))
    assert float(out["values2"].abs().max()) > 1e-2  # a trained head: the comparison can fail
    assert tensor_within(out["values2"], hf_values, rtol=FP32_MODEL), (out["values2"] - hf_values).abs().max()


def test_the_policy_and_value_passes_refuse_the_other_kind(run, run_world):
    out, _, lm_dir = run
    assert len(out["errors"]) == 2
    assert all("is a value model (TrainConfig.value_head); it has no LM head" in e for e in out["errors"])
    msg = run_world(_policy_worker, 1, lm_dir)[0]
    assert msg.startswith("compute_values: this FSDPBackend is a policy (TrainConfig.value_head is False)")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_every_packed_form_reads_the_values_at_the_predicting_positions(tiny_qwen2, tmp_path, attn):
    """thd as the padded grid and as one row under the block-diagonal mask, and padded bshd rows:
    the values of every response token equal each sample's own forward at the position before it."""
    from rl_plugin.backends.fsdp.model import load_hf_model
    from rl_plugin.backends.fsdp.value_model import micro_batch_values
    from rl_plugin.loss import MicroBatchInputs

    model = load_hf_model(value_checkpoint(tmp_path, tiny_qwen2), attn_implementation=attn, value_head=True).eval()
    batch = step_batch(value_step_data(0))
    cpu = torch.device("cpu")
    with torch.no_grad():
        want = alone_values(model, batch)
        forms = {
            "thd grid": micro_batch_values(model, MicroBatchInputs.build(batch), attn, cpu, padded_grid=True),
            "thd row": micro_batch_values(model, MicroBatchInputs.build(batch), attn, cpu, padded_grid=False),
            "bshd": micro_batch_values(
                model, MicroBatchInputs.build(batch, qkv_format="bshd", max_seq_len=16), attn, cpu
            ),
        }
    assert float(want.abs().max()) > 0.1
    for name, got in forms.items():
        assert got.shape == (want.numel(), 1) and got.dtype == torch.float32, name
        assert tensor_within(got[:, 0], want, rtol=FP32_MODEL), (name, float((got[:, 0] - want).abs().max()))


def _save_worker(rank, world, lm_dir, path):
    from rl_plugin.loss.micro_batch_plan import split_samples_for_dp

    b = value_backend(value_flags(lm_dir, *ADAM))
    data = value_step_data(0)
    local = step_batch(data).select(split_samples_for_dp(data["total_lengths"].numel(), world)[rank])
    b.value_train_step(local, num_groups=3, value_clip=VALUE_CLIP)
    b.value_train_step(local, num_groups=3, value_clip=VALUE_CLIP)
    b.save_checkpoint(path, step=2)
    weights = b.export_hf_state_dict()
    report = b.value_train_step(local, num_groups=3, value_clip=VALUE_CLIP)
    return dict(weights=weights, report=report)


def _load_worker(rank, world, lm_dir, path):
    b = value_backend(value_flags(lm_dir, *ADAM))
    meta = b.load_checkpoint(path)
    weights = b.export_hf_state_dict()
    report = b.value_train_step(step_batch(value_step_data(0)), num_groups=3, value_clip=VALUE_CLIP)
    return dict(weights=weights, step=meta["step"], report=report)


def test_a_dp2_checkpoint_resumes_on_dp1(run_world, tiny_qwen2, tmp_path):
    """DCP reshards the critic (weights and AdamW state): the DP1 run resumes with the DP2 run's
    exact weights, and its next step is the DP2 run's next step (same J, grad norm, lr)."""
    saved = run_world(_save_worker, 2, tiny_qwen2, str(tmp_path / "iter_2"))[0]
    loaded = run_world(_load_worker, 1, tiny_qwen2, str(tmp_path / "iter_2"))[0]
    assert loaded["step"] == 2
    assert all(torch.equal(loaded["weights"][k], v) for k, v in saved["weights"].items())
    for key in ("value_loss", "vf_clipfrac", "values_mean", "grad_norm", "lr"):
        assert abs(loaded["report"][key] - saved["report"][key]) <= FP32_MODEL * max(1.0, abs(saved["report"][key])), (
            key
        )
