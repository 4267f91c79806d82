"""The rollout manager: owns the prompt datasets, the generation engine(s) and the reward function.

One instance lives in a Ray actor (``rl_plugin.ray.rollout_actor``). Per rollout it takes
``--rollout-batch-size`` prompts, samples ``--n-samples-per-prompt`` responses each (a prompt's
samples are contiguous and form one group), scores them, and returns a ``RolloutData`` of flat
tensors. Generation is seeded with ``seed + rollout_id``, so a resumed run regenerates exactly
what the uninterrupted run would have, whatever happened before.

Engines: the single ``hf`` engine runs in this process; otherwise the engines are actors
(``rl_plugin.ray.engine_actor``). A rollout's prompt groups are cut into contiguous shares, one
per engine, generated concurrently and gathered back in group order; each sample carries its
index in the rollout (``first_sample``), so per-sample-seeded engines (vllm, sglang) sample the
same tokens however many engines there are.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

from rl_plugin.rollout.dataset import PromptDataset
from rl_plugin.rollout.engine import Generation, SamplingParams, make_engine
from rl_plugin.rollout.weight_sync import ObjectStoreTransport
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


def group_shares(num_groups: int, num_engines: int) -> List[int]:
    """Prompt groups per engine: as even as possible, the first engines taking the remainder."""
    base, extra = divmod(num_groups, num_engines)
    return [base + (1 if i < extra else 0) for i in range(num_engines)]


class RolloutManager:
    def __init__(self, args, checkpoint_dir: str, train_data: str, eval_data: Optional[str], engines: Optional[Sequence[Any]] = None):
        torch.set_num_threads(1)
        self.args = args
        self.tokenizer = load_tokenizer(checkpoint_dir, apply_chat_template=args.apply_chat_template)
        device = "cuda" if torch.cuda.is_available() else "cpu"  # Ray exposes the actor's GPU (if any) as device 0
        self.engines = list(engines or [])  # engine actors; empty: the engine lives here
        self.engine = None if self.engines else make_engine(args.rollout_engine, checkpoint_dir, device=device)
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
        gens = self._generate([p for p in prompt_ids for _ in range(n)], n, seed=seed)
        gen_time = time.perf_counter() - t0
        responses = [self.tokenizer.decode(g.response_ids) for g in gens]
        prompts = [r.prompt for r in recs for _ in range(n)]
        labels = [r.label for r in recs for _ in range(n)]
        rewards = torch.tensor(score_responses(self.reward_fn, prompts, responses, labels), dtype=torch.float32)
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

    def _generate(self, prompts: List[List[int]], n: int, *, seed: int) -> List[Generation]:
        """All samples (``n`` per group, groups contiguous), spread over the engines by whole
        groups and gathered in order."""
        if self.engine is not None:
            return self.engine.generate(prompts, self.params, seed=seed)
        import ray

        refs, start = [], 0
        for engine, groups in zip(self.engines, group_shares(len(prompts) // n, len(self.engines))):
            if groups:
                refs.append(engine.generate.remote(prompts[start : start + groups * n], self.params, seed, start))
            start += groups * n
        return [g for part in ray.get(refs) for g in part]

    # -- weights ------------------------------------------------------------------------------
    def update_weights(self, handles: Sequence[Any]) -> Dict[str, float]:
        """Load the buckets behind ``handles`` (``rl_plugin.rollout.weight_sync``) into every
        engine, in place; returns the bytes per engine and the slowest engine's seconds."""
        if self.engine is not None:
            t0, nbytes = time.perf_counter(), 0
            for bucket in ObjectStoreTransport().receive(handles):
                self.engine.update_weights(bucket)
                nbytes += sum(t.numel() * t.element_size() for t in bucket.values())
            return {"bytes": float(nbytes), "seconds": time.perf_counter() - t0}
        import ray

        stats = ray.get([e.update_weights.remote(handles) for e in self.engines])
        return {"bytes": stats[0]["bytes"], "seconds": max(s["seconds"] for s in stats)}

    def weights_fingerprint(self) -> List[Dict[str, str]]:
        """One fingerprint per engine (``--check-weight-sync`` checks every engine)."""
        if self.engine is not None:
            return [weights_fingerprint(self.engine.weights())]
        import ray

        return ray.get([e.weights_fingerprint.remote() for e in self.engines])

    # -- resume -------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, object]:
        return {"train_dataset": self.train.state_dict()}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        self.train.load_state_dict(state["train_dataset"])
