"""Start-up rules of LoRA (``configs/lora.py``): each raises naming the flag, the rule and the fix."""

from __future__ import annotations

import json

import pytest

from rl_plugin.arguments import RLArgumentError, parse_args
from rl_plugin.lora.peft_dir import write_peft_dir

FSDP = ["--train-backend", "fsdp"]
DATA = [
    "--prompt-data",
    "p.jsonl",
    "--rollout-batch-size",
    "4",
    "--rollout-max-response-len",
    "8",
    "--num-rollout",
    "2",
    "--rm-type",
    "math_exact",
]


def refused(flags, *words):
    with pytest.raises(RLArgumentError) as err:
        parse_args(FSDP + flags)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


@pytest.mark.parametrize(
    "flag", [["--check-lora-weight-equal"], ["--lora-adapter-path", "/x"], ["--save-hf-merged", "/x"]]
)
def test_lora_flags_need_lora_rank(flag):
    refused(flag, f"{flag[0]} without --lora-rank", "--lora-rank 8")


def test_unknown_target_names_the_flag():
    refused(["--lora-rank", "8", "--target-modules", "qkv"], "--target-modules qkv", "not a linear LoRA can target")
    refused(["--lora-rank", "8", "--exclude-modules", "lm_head"], "--exclude-modules lm_head")
    refused(["--lora-rank", "8", "--target-modules", "q_proj", "--exclude-modules", "q_proj"], "selects no linear")


def test_adapter_path_must_be_a_peft_directory(tmp_path):
    refused(
        ["--lora-rank", "8", "--lora-adapter-path", str(tmp_path)],
        "adapter_config.json, adapter_model.safetensors missing",
    )
    import torch

    write_peft_dir(
        str(tmp_path), {"m.q_proj.lora_A.weight": torch.zeros(8, 4)}, rank=8, alpha=16, dropout=0, targets=["q_proj"]
    )
    parse_args(FSDP + ["--lora-rank", "8", "--lora-adapter-path", str(tmp_path)])


def test_dropout_refused_with_engine_log_probs_as_old():
    refused(
        ["--lora-rank", "8", "--lora-dropout", "0.1", "--use-rollout-logprobs"],
        "--lora-dropout 0.1 with --use-rollout-logprobs",
        "--lora-dropout 0",
    )
    parse_args(FSDP + ["--lora-rank", "8", "--lora-dropout", "0.1"])  # dropout alone: the old log-probs are recomputed


def test_sglang_refused():
    refused(["--lora-rank", "8", "--rollout-engine", "sglang"], "--rollout-engine sglang", "use --rollout-engine vllm")


def test_vllm_read_back_needs_a_power_of_two_scaling():
    refused(
        ["--lora-rank", "8", "--lora-alpha", "12", "--rollout-engine", "vllm", "--check-lora-weight-equal"],
        "bitwise only for a power of two",
        "--lora-alpha 16",
    )
    parse_args(
        FSDP + ["--lora-rank", "8", "--lora-alpha", "16", "--rollout-engine", "vllm", "--check-lora-weight-equal"]
    )


def test_moe_expert_targets_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 4}))
    refused(
        ["--hf-checkpoint", str(tmp_path), *DATA, "--lora-rank", "8"],
        "mixture-of-experts",
        "--exclude-modules gate_proj up_proj down_proj",
    )
    parse_args(
        FSDP + ["--hf-checkpoint", str(tmp_path), *DATA, "--lora-rank", "8"] + ["--target-modules", "q_proj", "v_proj"]
    )


def test_vllm_in_place_pause_refused_with_lora():
    refused(
        ["--lora-rank", "8", "--rollout-engine", "vllm", "--fully-async", "--max-weight-staleness", "1"]
        + ["--pause-generation-mode", "in_place"],
        "--pause-generation-mode in_place",
        "use --pause-generation-mode retract",
    )


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--lora-alpha", "32"], "--lora-alpha 32 with --lora-rank 0"),
        (["--target-modules", "q_proj", "v_proj"], "--target-modules q_proj v_proj with --lora-rank 0"),
        (["--exclude-modules", "o_proj"], "--exclude-modules o_proj with --lora-rank 0"),
        (["--lora-dropout", "0.1", "--lora-alpha", "8"], "--lora-alpha 8 --lora-dropout 0.1 with --lora-rank 0"),
    ],
)
def test_adapter_shape_flags_without_lora_rank_are_refused(flags, named):
    """Issue 44 item 24. Before: accepted, and the whole model trained with no word about them."""
    refused(flags, named, "LoRA is off at rank 0", "add --lora-rank 8", "drop those flags")
    parse_args(FSDP + ["--lora-alpha", "16", "--target-modules", "all-linear"])  # the defaults, spelled out
