"""The rollout manager: owns the prompt datasets, the generation engine and the reward function.

One instance lives in a Ray actor (``rl_plugin.ray.rollout_actor``). Per rollout it takes
``--rollout-batch-size`` prompts, samples ``--n-samples-per-prompt`` responses each (a prompt's
samples are contiguous and form one group), scores them, and returns a ``RolloutData`` of flat
tensors. Generation is seeded with ``seed + rollout_id``, so a resumed run regenerates exactly
what the uninterrupted run would have, whatever happened before.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from rl_plugin.rollout.dataset import PromptDataset
from rl_plugin.rollout.engine import SamplingParams, make_engine
from rl_plugin.rollout.rewards import load_reward_fn, score_responses
from rl_plugin.rollout.tokenizer import load_tokenizer

EVAL_SEED_OFFSET = 1_000_003


@dataclass
class RolloutData:
    """One rollout, samples ordered by prompt group. ``tokens``: prompt + response of every sample
    (``[sum T_i]``); ``rollout_log_probs``: the sampler's log-prob of each response token."""

    tokens: torch.Tensor
    total_lengths: torch.Tensor
    response_lengths: torch.Tensor
    rollout_log_probs: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    num_groups: int
    stats: Dict[str, float] = field(default_factory=dict)
    examples: List[Dict[str, object]] = field(default_factory=list)


def weights_fingerprint(state_dict: Dict[str, torch.Tensor]) -> Dict[str, str]:
    """sha256 of every tensor's bytes (fp32, contiguous): equal fingerprints = bitwise-equal weights."""
    out = {}
    for name in sorted(state_dict):
        t = state_dict[name].detach().to("cpu", torch.float32).contiguous()
        out[name] = hashlib.sha256(t.numpy().tobytes()).hexdigest()
    return out


class RolloutManager:
    def __init__(self, args, checkpoint_dir: str, train_data: str, eval_data: Optional[str]):
        torch.set_num_threads(1)
        self.args = args
        self.tokenizer = load_tokenizer(checkpoint_dir, apply_chat_template=args.apply_chat_template)
        device = "cuda" if torch.cuda.is_available() else "cpu"  # Ray exposes the actor's GPU (if any) as device 0
        self.engine = make_engine(args.rollout_engine, checkpoint_dir, device=device)
        self.reward_fn = load_reward_fn(args.rm_type, args.custom_rm_path)
        self.train = PromptDataset.from_jsonl(train_data, args.input_key, args.label_key, shuffle=args.rollout_shuffle, seed=args.seed)
        self.eval = PromptDataset.from_jsonl(eval_data, args.input_key, args.label_key) if eval_data else None
        self.params = SamplingParams(args.rollout_temperature, args.rollout_top_p, args.rollout_max_response_len)

    # -- generation ---------------------------------------------------------------------------
    def generate(self, rollout_id: int) -> RolloutData:
        recs = self.train.next_batch(self.args.rollout_batch_size)
        return self._rollout(recs, self.args.n_samples_per_prompt, seed=self.args.seed + rollout_id)

    def evaluate(self, rollout_id: int) -> Dict[str, float]:
        if self.eval is None:
            raise ValueError("--eval-interval needs held-out prompts: pass --eval-prompt-data (the embedded default makes them)")
        data = self._rollout(self.eval.records, self.args.n_samples_per_eval, seed=self.args.seed + EVAL_SEED_OFFSET + rollout_id)
        return {"eval/reward_mean": data.stats["reward_mean"], "eval/response_len_mean": data.stats["response_len_mean"]}

    def _rollout(self, recs, n: int, *, seed: int) -> RolloutData:
        t0 = time.perf_counter()
        prompt_ids = [self.tokenizer.prompt_ids(r.prompt) for r in recs]
        gens = self.engine.generate([p for p in prompt_ids for _ in range(n)], self.params, seed=seed)
        gen_time = time.perf_counter() - t0
        responses = [self.tokenizer.decode(g.response_ids) for g in gens]
        prompts = [r.prompt for r in recs for _ in range(n)]
        labels = [r.label for r in recs for _ in range(n)]
        t1 = time.perf_counter()
        rewards = torch.tensor(score_responses(self.reward_fn, prompts, responses, labels), dtype=torch.float32)
        reward_time = time.perf_counter() - t1  # timed apart from generation: a slow verifier shows up as such
        empty = [i for i, g in enumerate(gens) if not g.response_ids]
        if empty:
            raise RuntimeError(f"rollout sample {empty[0]} (prompt {prompts[empty[0]]!r}) has an empty response; check --rollout-max-response-len >= 1")
        rl = torch.tensor([len(g.response_ids) for g in gens], dtype=torch.long)
        tl = torch.tensor([len(g.prompt_ids) + len(g.response_ids) for g in gens], dtype=torch.long)
        stats = {
            "reward_mean": float(rewards.mean()),
            "reward_max": float(rewards.max()),
            "response_len_mean": float(rl.float().mean()),
            "truncated_frac": float(sum(not g.finished for g in gens) / len(gens)),
            "rollout_gen_time": gen_time,
            "rollout_reward_time": reward_time,
        }
        return RolloutData(
            tokens=torch.tensor([t for g in gens for t in g.prompt_ids + g.response_ids], dtype=torch.long),
            total_lengths=tl,
            response_lengths=rl,
            rollout_log_probs=torch.tensor([x for g in gens for x in g.log_probs], dtype=torch.float32),
            rewards=rewards,
            group_ids=torch.arange(len(recs)).repeat_interleave(n),
            num_groups=len(recs),
            stats=stats,
            examples=[{"prompt": prompts[i], "response": responses[i], "reward": float(rewards[i])} for i in range(min(2, len(gens)))],
        )

    # -- weights ------------------------------------------------------------------------------
    def update_weights(self, state_dict: Dict[str, torch.Tensor]) -> None:
        self.engine.update_weights(state_dict)

    def weights_fingerprint(self) -> Dict[str, str]:
        return weights_fingerprint(self.engine.weights())

    # -- resume -------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, object]:
        return {"train_dataset": self.train.state_dict()}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        self.train.load_state_dict(state["train_dataset"])
