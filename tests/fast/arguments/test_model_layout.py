"""Issue 28 #4: a model whose sizes the layout cannot split is refused before anything starts,
naming the numbers and the sizes that work (``rl_plugin.arguments.model_layout``)."""

from __future__ import annotations

import json

import pytest

from rl_plugin.arguments import RLArgumentError
from rl_plugin.arguments.model_layout import check_model_layout
from tests.support.flag_rules import parse_args

SMOLLM2 = {"num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}


def _model(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def _check(flags, model_dir):
    args = parse_args(flags.split())
    args.hf_checkpoint = model_dir
    check_model_layout(args)


def test_tp_that_cannot_split_the_heads_names_the_divisors(tmp_path):
    d = _model(tmp_path, **SMOLLM2)
    with pytest.raises(RLArgumentError) as err:
        _check("--tensor-model-parallel-size 2 --actor-num-gpus-per-node 2", d)
    msg = str(err.value)
    assert "--tensor-model-parallel-size 2" in msg and "the model has 9 attention heads" in msg, msg
    assert "one of 1, 3, 9" in msg and "Fix:" in msg
    _check("--tensor-model-parallel-size 3 --actor-num-gpus-per-node 3", d)  # 9 heads, 3 KV heads: fine


def test_kv_heads_are_split_too(tmp_path):
    d = _model(tmp_path, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=4)
    with pytest.raises(RLArgumentError, match="the model has 2 KV heads, which 4 ranks cannot split evenly"):
        _check("--tensor-model-parallel-size 4 --actor-num-gpus-per-node 4", d)


def test_fsdp_has_no_tensor_parallel_rule(tmp_path):
    _check("--train-backend fsdp", _model(tmp_path, **SMOLLM2))


def test_multi_gpu_vllm_engine_is_not_refused_for_the_drivers_missing_cuda(tmp_path):
    """Issue 37 #6: a CPU head node with RAY_ADDRESS on a GPU cluster. Whether the engine gets GPUs
    is the placement's decision from the cluster's resources (tests/fast/ray/test_placement.py), so
    the flag checker on this CUDA-less driver accepts a multi-GPU vLLM engine; only an explicit
    --placement-device cpu is refused here (the engine config's rule)."""
    d = _model(tmp_path, **SMOLLM2)
    flags = "--rollout-engine vllm --rollout-num-gpus-per-engine 3 --rollout-num-gpus 3"
    _check(flags, d)  # refused before the fix: "a multi-GPU vLLM engine ... needs CUDA GPUs"
    with pytest.raises(RLArgumentError) as err:
        _check(flags + " --placement-device cpu", d)
    msg = str(err.value)
    assert "--rollout-num-gpus-per-engine 3 with --placement-device cpu" in msg, msg
    assert "a multi-GPU vLLM engine (its tensor parallelism) needs GPU bundles" in msg and "Fix:" in msg, msg
    with pytest.raises(RLArgumentError, match="the model has 9 attention heads, which 2 ranks cannot split"):
        _check("--rollout-engine vllm --rollout-num-gpus-per-engine 2 --rollout-num-gpus 2", d)  # heads still split


def test_an_moe_model_inside_a_pipeline_is_refused_naming_both(tmp_path):
    d = _model(tmp_path, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, num_experts=4)
    with pytest.raises(RLArgumentError) as err:
        _check("--pipeline-model-parallel-size 2 --actor-num-gpus-per-node 2", d)
    msg = str(err.value)
    assert "--pipeline-model-parallel-size 2" in msg and "the model has 4 experts" in msg and "Fix:" in msg, msg
    _check("--expert-model-parallel-size 2 --actor-num-gpus-per-node 2", d)  # experts split over EP instead: fine
    dense = _model(tmp_path, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4)
    _check("--pipeline-model-parallel-size 2 --actor-num-gpus-per-node 2", dense)  # a dense model: fine


def test_virtual_pipeline_chunks_must_split_the_layers(tmp_path):
    """The interleaved schedule: layers / (P x layers per chunk) chunks per rank, an even split and
    at least two chunks (one is plain 1F1B), checked against the model before anything starts."""
    d = _model(tmp_path, **SMOLLM2)  # 30 layers: 15 per rank at PP2
    pp2 = "--pipeline-model-parallel-size 2 --actor-num-gpus-per-node 2"
    _check(f"{pp2} --num-layers-per-virtual-pipeline-stage 5", d)  # 3 chunks of 5 layers per rank
    _check(f"{pp2} --num-virtual-stages-per-pipeline-rank 3", d)
    with pytest.raises(RLArgumentError) as err:
        _check(f"{pp2} --num-layers-per-virtual-pipeline-stage 4", d)
    msg = str(err.value)
    assert "--num-layers-per-virtual-pipeline-stage 4 with --pipeline-model-parallel-size 2" in msg, msg
    assert "30 layers" in msg and "Fix: use --num-layers-per-virtual-pipeline-stage with one of 1, 3, 5 (15" in msg, msg
    # issue 38: the fix is stated in the units of the flag given (chunks per rank here, not layers per chunk)
    with pytest.raises(RLArgumentError) as err:
        _check(f"{pp2} --num-virtual-stages-per-pipeline-rank 2", d)
    msg = str(err.value)
    assert (
        "do not split evenly" in msg and "Fix: use --num-virtual-stages-per-pipeline-rank with one of 3, 5, 15" in msg
    ), msg
    with pytest.raises(RLArgumentError, match="one chunk of 15 layers per stage, the plain 1F1B schedule"):
        _check(f"{pp2} --num-layers-per-virtual-pipeline-stage 15", d)


def test_virtual_pipeline_needs_pipeline_stages_and_one_flag():
    with pytest.raises(
        RLArgumentError, match="--num-layers-per-virtual-pipeline-stage 1 with --pipeline-model-parallel-size 1"
    ):
        parse_args(["--num-layers-per-virtual-pipeline-stage", "1"])
    with pytest.raises(RLArgumentError, match="pass only one of them"):
        parse_args(
            "--pipeline-model-parallel-size 2 --actor-num-gpus-per-node 2 --num-layers-per-virtual-pipeline-stage 1 "
            "--num-virtual-stages-per-pipeline-rank 2".split()
        )
    with pytest.raises(RLArgumentError, match="--num-layers-per-virtual-pipeline-stage"):
        parse_args(
            "--pipeline-model-parallel-size 2 --actor-num-gpus-per-node 2 --num-layers-per-virtual-pipeline-stage 0".split()
        )
