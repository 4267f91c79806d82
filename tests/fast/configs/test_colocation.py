"""Issue 37 item 2: the colocation flags' rules (``configs/colocation.py``) and their defaults."""

from __future__ import annotations

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.configs import EngineConfig
from rl_plugin.loop.config import LoopConfig
from tests.support.flag_rules import assert_refused

REFUSED = [
    ("--offload-train", ["--offload-train without --colocate", "add --colocate"]),
    ("--colocate --rollout-gpu-memory-utilization 0", ["--rollout-gpu-memory-utilization", "(0, 1]"]),
    ("--colocate --rollout-gpu-memory-utilization 1.5", ["--rollout-gpu-memory-utilization", "(0, 1]"]),
    ("--sglang-mem-fraction-static 0.7", ["--sglang-mem-fraction-static with --rollout-engine hf"]),
    (
        "--colocate --rollout-engine vllm --rollout-num-gpus-per-engine 2 --actor-num-gpus-per-node 3",
        ["--rollout-num-gpus-per-engine 2", "--actor-num-gpus-per-node 3", "divide"],
    ),
    (
        "--colocate --update-weight-transport distributed --placement-device gpu",
        ["--colocate with --update-weight-transport distributed on GPUs", "NCCL", "--update-weight-transport auto"],
    ),
    (
        "--colocate --update-weight-transport nccl --placement-device gpu",
        ["--update-weight-transport nccl", "shared memory"],
    ),
    (  # the vLLM teacher shares engine 0's GPU: 0.5 (the colocated default) + 0.6
        "--colocate --rollout-engine vllm --use-opd --opd-teacher-load d --opd-type vllm "
        "--opd-teacher-gpu-memory-utilization 0.6",
        [
            "--opd-type vllm with --colocate: --rollout-gpu-memory-utilization 0.5 + "
            "--opd-teacher-gpu-memory-utilization 0.6 >= 1",
            "the GPU of engine 0",
            "sum below 1 (the defaults: 0.5 + 0.3)",
        ],
    ),
]


@pytest.mark.parametrize("flags,fragments", REFUSED, ids=[f for f, _ in REFUSED])
def test_refused(flags, fragments):
    assert_refused(flags, fragments)


def test_memory_share_defaults_leave_room_for_training_when_colocated():
    assert EngineConfig.from_args(parse_args([])).colocation.memory_share() == 0.9  # vLLM's own
    colocated = EngineConfig.from_args(parse_args(["--colocate"])).colocation
    assert colocated.memory_share() == 0.5 and colocated.colocate
    given = parse_args(["--colocate", "--offload-train", "--rollout-gpu-memory-utilization", "0.8"])
    assert EngineConfig.from_args(given).colocation.memory_share() == 0.8
    assert LoopConfig.from_args(given).offload_train


def test_colocated_tp_engines_and_the_cpu_broadcast_are_accepted():
    parse_args("--colocate --rollout-engine vllm --rollout-num-gpus-per-engine 2 --actor-num-gpus-per-node 4".split())
    parse_args("--colocate --update-weight-transport distributed".split())  # on CPUs (gloo) it works


def test_vllm_teacher_share_beside_a_colocated_engine_is_accepted_below_one():
    args = parse_args(
        "--colocate --rollout-engine vllm --rollout-gpu-memory-utilization 0.6 --use-opd --opd-teacher-load d "
        "--opd-type vllm --opd-teacher-gpu-memory-utilization 0.3".split()
    )
    assert args.opd_teacher_gpu_memory_utilization == 0.3
