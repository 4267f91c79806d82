"""The RL generation source (``rl_plugin.rollout.generation.source.GenerationSource``) on the real
embedded model and ``hf`` engine (built by the rollout manager, in this process): DAPO's over-long
penalty against its formula on the model-token counts, the debug log-prob shift by exactly d, the
eval on the held-out prompts leaving the training position where it was, the refusal of an eval
without held-out prompts, and the model facts it reads from the checkpoint."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from rl_plugin.arguments.embedded import parse_train_flags
from rl_plugin.configs import RolloutConfig
from rl_plugin.loop.embedded_setup import prepare_embedded
from rl_plugin.rollout.manager import RolloutManager

B, N, MAX_LEN = 3, 2, 8


def _source(tmp_path, *extra, eval_data=False):
    args = parse_train_flags(
        ["--n-samples-per-prompt", str(N), "--rollout-batch-size", str(B), "--output-dir", str(tmp_path / "out")]
        + ["--rollout-max-response-len", str(MAX_LEN)]
        + list(extra)
    )
    prepare_embedded(args)
    torch.manual_seed(0)
    m = RolloutManager(
        RolloutConfig.from_args(args),
        args.hf_checkpoint,
        args.prompt_data,
        args.eval_prompt_data if eval_data else None,
        args=args,
    )
    return m.generation, args


def test_the_overlong_penalty_is_dapos_formula_on_the_model_tokens(tmp_path):
    plain, _ = _source(tmp_path / "a")
    raw = plain.rollout(0)
    shaped_src, _ = _source(tmp_path / "b", "--overlong-buffer-len", "4", "--overlong-penalty-factor", "0.5")
    data = shaped_src.rollout(0)
    assert torch.equal(data.tokens, raw.tokens)  # same seed, same samples: only the rewards move
    lengths = raw.response_lengths.tolist()
    want = [-0.5 * min(max(n - (MAX_LEN - 4), 0), 4) / 4 for n in lengths]
    assert data.rewards.tolist() == pytest.approx([r + p for r, p in zip(raw.rewards.tolist(), want)], abs=1e-7)
    assert data.stats["overlong/penalty_mean"] == pytest.approx(sum(want) / len(want), abs=1e-7)
    assert data.stats["overlong/penalized_frac"] == pytest.approx(sum(p < 0 for p in want) / len(want))
    assert data.stats["reward_shaped_mean"] == pytest.approx(float(data.rewards.mean()))
    assert "overlong/penalty_mean" not in raw.stats


def test_the_debug_shift_moves_every_log_prob_by_exactly_d(tmp_path):
    plain, _ = _source(tmp_path / "a")
    shifted, _ = _source(tmp_path / "b", "--debug-rollout-logprob-shift", "0.25")
    a, b = plain.rollout(0), shifted.rollout(0)
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(b.rollout_log_probs, a.rollout_log_probs - 0.25)


def test_the_eval_uses_the_held_out_prompts_and_keeps_the_position(tmp_path):
    src, args = _source(tmp_path, eval_data=True)
    src.rollout(0)
    before = src.state_dict()
    out = src.evaluate(0)
    assert set(out) == {"eval/reward_mean", "eval/response_len_mean"}
    assert 0.0 <= out["eval/reward_mean"] <= 1.0 and 1.0 <= out["eval/response_len_mean"] <= MAX_LEN
    assert src.state_dict() == before == {"train_dataset": {"epoch": 0, "offset": B}}
    assert src.evaluate(0) == out  # seeded by the rollout id: the same eval twice


def test_an_eval_without_held_out_prompts_is_refused(tmp_path):
    src, _ = _source(tmp_path)
    with pytest.raises(ValueError, match=r"^--eval-interval needs held-out prompts: pass --eval-prompt-data"):
        src.evaluate(0)


def test_model_facts_and_who_generates(tmp_path):
    src, args = _source(tmp_path)
    cfg = AutoConfig.from_pretrained(args.hf_checkpoint)
    assert src.vocab_size == cfg.vocab_size and src.context_len == cfg.max_position_embeddings
    assert src.describe() == "the hf engine"
