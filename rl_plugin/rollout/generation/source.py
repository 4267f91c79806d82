"""The RL generation source: one rollout made on the fleet's engines, slime's sample path.

Per rollout it takes ``--rollout-batch-size`` prompts (``PromptQueue``: re-queued ones first) and:

1. generates ``--n-samples-per-prompt`` ``Sample``s per prompt (a prompt's samples are contiguous
   and form one group) with the default generate function (``default.DefaultGenerate``: one engine
   call per engine for the whole batch) or, with ``--custom-generate-function-path``, the user's
   hook per sample (``hooks.run_generate_hook``; its ``generate_tokens`` requests batched to the
   engines by ``generate.EngineRouter``, seeded from the rollout's seed; what it returns is checked,
   ``sample_check``);
2. scores them (``rewards.scorer.SampleScorer``, every reward form);
3. flattens them once into the tensors of a ``RolloutData`` (``flatten.flatten_samples``).

With ``--rollout-function-path`` the user's function replaces step 1 for the whole rollout (and
returns ``Sample``s too); with ``--custom-agent-function-path`` an agent program runs per sample
(``rl_plugin.rollout.agent``). Generation is seeded with ``seed + rollout_id``, so a resumed run
regenerates exactly what the uninterrupted run would have, whatever happened before.

With ``--dynamic-sampling-filter-path`` (DAPO dynamic sampling, ``dapo/dynamic_sampling.py``) a
rollout runs in rounds of ``--over-sampling-batch-size`` prompts (round r > 0 seeded ``seed +
rollout_id + r * ROUND_SEED_STRIDE``) until ``--rollout-batch-size`` groups have passed the filter
(slime's ``fn(args, samples)`` over one group's scored ``Sample``s, on their raw rewards); the first
``--rollout-batch-size`` passing groups, in generation order, are the rollout and the rest are
dropped (as slime does); every round after the first prints one progress line (at most
``--dynamic-sampling-max-rounds`` rounds). ``--overlong-buffer-len`` then adds DAPO's over-long
penalty to the rewards the advantages are computed from (counting the model's tokens, the loss
mask's sum); ``reward_mean`` stays the raw reward (``shaped``).

The fully-async source (``fully_async/``) generates through the same parts: ``hook_generate``,
``assemble`` and ``shaped`` are its seams.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from rl_plugin.configs import RolloutConfig
from rl_plugin.phases import record
from rl_plugin.rollout import abort
from rl_plugin.rollout.agent.rollout import AgentRollout
from rl_plugin.rollout.dapo.dynamic_sampling import dynamic_rollout
from rl_plugin.rollout.dapo.filters import load_filter, overlong_penalty
from rl_plugin.rollout.data.dataset import PromptDataset
from rl_plugin.rollout.data.prompt_queue import PromptQueue
from rl_plugin.rollout.engines.base import SamplingParams
from rl_plugin.rollout.engines.teacher import make_teacher
from rl_plugin.rollout.flatten import flatten_samples, rollout_stats
from rl_plugin.rollout.fleet import EngineFleet
from rl_plugin.rollout.generation.default import DefaultGenerate
from rl_plugin.rollout.generation.hooks import (
    GENERATE_FLAG,
    ROLLOUT_FLAG,
    DataSource,
    Hook,
    check_groups,
    default_sampling_params,
    engine_dispatch,
    fresh_samples,
    multi_turn_stats,
    run_generate_hook,
    run_rollout_function,
)
from rl_plugin.rollout.rewards.scorer import SampleScorer
from rl_plugin.rollout.sample import RolloutData, Sample
from rl_plugin.rollout.sample_check import (
    check_distinct,
    check_log_probs,
    check_samples,
    check_trainable,
    duplicate_groups,
    hold_to_limits,
    say_once,
)
from rl_plugin.rollout.vl_turns import check_image_tokens, drop_cut_images
from rl_plugin.weight_sync import SyncHandle

EVAL_SEED_OFFSET = 1_000_003
ROUND_SEED_STRIDE = 3_000_017


def _progress_line(line: str) -> None:
    """Dynamic sampling's per-round line, flushed (the actor's stdout reaches the driver's log)."""
    print(line, flush=True)


class GenerationSource:
    def __init__(
        self,
        config: RolloutConfig,
        checkpoint_dir: str,
        tokenizer: Any,
        fleet: EngineFleet,
        prompts: PromptQueue,
        eval_prompts: Optional[PromptDataset],
        *,
        hook_args: Any,
        device: str,
    ):
        cfg = self.config = config
        self.checkpoint_dir, self.tokenizer, self.fleet = checkpoint_dir, tokenizer, fleet
        self.prompts, self.eval = prompts, eval_prompts
        self.hook_args = hook_args  # the user's hooks get it as slime's ``args``; never read here
        # every reward form: built-in, custom, slime's rm(args, sample), group, remote
        self.scorer = SampleScorer(cfg, user_args=hook_args)
        self.params = SamplingParams(cfg.engine.temperature, cfg.engine.top_p, cfg.engine.max_response_len)
        path = cfg.dynamic_sampling_filter_path
        self.group_filter = load_filter(path) if path else None
        hook, fn = cfg.custom_generate_function_path, cfg.rollout_function_path
        self.generate_hook = Hook.load(hook, GENERATE_FLAG) if hook else None
        self.rollout_fn = Hook.load(fn, ROLLOUT_FLAG) if fn else None
        # the generate function: (records, n, seed) -> Samples; the user's hook replaces the default
        default = DefaultGenerate(tokenizer, self.params, fleet.engine, fleet.actors)
        self.generate_samples = default if self.generate_hook is None else self.hook_generate
        # --use-opd --opd-type hf|vllm: the teacher scores each rollout's tokens here (engines/teacher.py)
        self.teacher = None
        if cfg.use_opd and cfg.opd_type in ("hf", "vllm"):
            self.teacher = make_teacher(
                cfg.opd_type,
                cfg.opd_teacher_load,
                temperature=cfg.engine.temperature,
                seed=cfg.seed,
                device=device,
                max_tokens=cfg.opd_teacher_max_tokens,
                memory_share=cfg.opd_teacher_gpu_memory_utilization,
            )
        agent = cfg.custom_agent_function_path  # an agent program per sample (rl_plugin.rollout.agent)
        self.agent = AgentRollout(agent, tokenizer, cfg, hook_args) if agent else None
        self._vocab_size: Optional[int] = None
        self._context_len: Optional[int] = None
        self._hook_stats: Dict[str, float] = {}  # the limits' and duplicates' counts of the hook's last samples

    # -- the source (``rollout.source.RolloutSource``) -------------------------------------------
    def rollout(self, rollout_id: int, handle: Optional[SyncHandle] = None) -> RolloutData:
        """Rollout ``rollout_id``; given a weight-sync ``handle`` (the trainer's newest weights,
        published by its last train call), the engines load it first (answered in
        ``data.weight_load``): the sync costs the loop no call of its own. Engine actors get the
        load and then their share of the rollout without a wait between: an actor runs its calls
        in order."""
        loading = self.fleet.start_load(handle, generating=True)
        record(f"engine.generate {rollout_id}")
        cfg = self.config
        if self.rollout_fn is not None:
            data = self._function_rollout(rollout_id, seed=cfg.seed + rollout_id)
        elif self.agent is not None:
            recs = self.prompts.next_batch(cfg.rollout_batch_size)
            n, seed = cfg.n_samples_per_prompt, cfg.seed + rollout_id
            args = (self.dispatch(), self.params, self.context_len, self.scorer)
            with abort.phase(f"the agent {self.agent.describe()}"):
                data = self.agent.rollout(recs, n, seed, *args, vocab_size=self.vocab_size)
        elif self.group_filter is None:
            recs = self.prompts.next_batch(cfg.rollout_batch_size)
            data, _ = self._rollout(recs, cfg.n_samples_per_prompt, seed=cfg.seed + rollout_id)
        else:
            data = dynamic_rollout(
                cfg,
                rollout_id,
                self.prompts.next_batch,
                self._rollout,
                self.group_filter,
                ROUND_SEED_STRIDE,
                progress=_progress_line,
            )
        data = self.shaped(data)
        data.dataset_state = self.state_dict()  # saves the driver a state_dict round trip per rollout
        data.weight_load = self.fleet.finish_load(handle, loading)
        self.fleet.sleep()
        return data

    def evaluate(self, rollout_id: int, handle: Optional[SyncHandle] = None) -> Dict[str, Any]:
        """The eval metrics on the held-out prompts after rollout ``rollout_id``; a given ``handle``
        (the weights after its train call: version ``rollout_id + 1``) is loaded first and its load
        answered under ``weight_load``."""
        loading = self.fleet.start_load(handle, generating=True)
        if self.eval is None:
            raise ValueError(
                "--eval-interval needs held-out prompts: pass --eval-prompt-data (the embedded default makes them)"
            )
        data, _ = self._rollout(
            self.eval.records, self.config.n_samples_per_eval, seed=self.config.seed + EVAL_SEED_OFFSET + rollout_id
        )
        out: Dict[str, Any] = {
            "eval/reward_mean": data.stats["reward_mean"],
            "eval/response_len_mean": data.stats["response_len_mean"],
        }
        if handle is not None:
            out["weight_load"] = self.fleet.finish_load(handle, loading, rollout_id + 1)
        self.fleet.sleep()
        return out

    def state_dict(self) -> Dict[str, Any]:
        """The dataset position, and the re-queued prompts not generated yet (``PromptQueue``)."""
        return self.prompts.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """A checkpoint's position; a fully-async checkpoint's ``async_requeue`` prompts are
        generated first (whatever this run's mode: none is skipped)."""
        self.prompts.load_state_dict(state)

    # -- the seams the fully-async source generates through ----------------------------------------
    def describe(self) -> str:
        """Who makes the samples: the generate hook, or the engine (named when a sample is refused)."""
        hook = self.generate_hook
        return hook.describe() if hook is not None else f"the {self.config.engine.engine} engine"

    def shaped(self, data: RolloutData) -> RolloutData:
        """A rollout's data after generation: the test shift, DAPO's over-long penalty, the OPD
        teacher's log-probs."""
        cfg = self.config
        if cfg.debug_rollout_logprob_shift:  # test hook: an engine that disagrees by exactly d per token
            data.rollout_log_probs = data.rollout_log_probs - cfg.debug_rollout_logprob_shift
        if cfg.overlong_buffer_len is not None:
            penalty = overlong_penalty(
                data.model_token_counts(),  # the model's tokens: tool output is not its length
                max_len=cfg.engine.max_response_len,
                buffer_len=cfg.overlong_buffer_len,
                factor=cfg.overlong_penalty_factor,
            )
            data.rewards = data.rewards + penalty  # after the filter decided on the raw rewards
            data.stats["overlong/penalty_mean"] = float(penalty.mean())
            data.stats["overlong/penalized_frac"] = float((penalty < 0).float().mean())
            data.stats["reward_shaped_mean"] = float(data.rewards.mean())
        if self.teacher is not None:
            data.teacher_log_probs = self.teacher.log_probs(data.tokens, data.total_lengths, data.response_lengths)
        return data

    def hook_generate(self, recs, n: int, seed: int, engine=None) -> List[Sample]:
        """The generate function of ``--custom-generate-function-path``: every sample through the
        user's hook, concurrently (``hooks.run_generate_hook``), then checked. ``engine``: the
        in-process engine to use instead (fully async: the gated one)."""
        hook, samples = self.generate_hook, fresh_samples(self.tokenizer, recs, n)
        params = default_sampling_params(self.params)
        out = run_generate_hook(
            hook,
            self.hook_args,
            samples,
            params,
            engine_dispatch(engine or self.fleet.engine, self.fleet.actors),
            seed,
            self.params,
            timeout=self.config.custom_generate_timeout,
            context_len=self.context_len,
            vocab_size=self.vocab_size,
            prompts=self.tokenizer,
        )
        return self._checked(out, hook, n)

    def assemble(
        self,
        samples: List[Sample],
        num_groups: int,
        gen_time: float,
        custom: bool = False,
        who: str = "the engine",
        rewards: Optional[torch.Tensor] = None,
    ) -> Tuple[RolloutData, List[Sample]]:
        """Samples (groups contiguous) scored and flattened into ``RolloutData``; ``custom``
        (a hook's samples) adds the ``multi_turn/*`` stats and the hook's counts. ``who`` made the
        samples: the hook or the engine, named when their log-probs or loss mask are refused.
        ``rewards``: scored already (fully async scores at put time)."""
        group_size = len(samples) // max(num_groups, 1)
        flat = flatten_samples(samples)
        rl = flat.response_lengths
        check_log_probs(flat.log_probs, flat.loss_mask, rl, samples, who)  # before the reward spends anything on them
        check_trainable(flat.loss_mask, who, len(samples))
        t1 = time.perf_counter()
        if rewards is None:
            rewards = torch.tensor(self.scorer.score_samples(samples, group_size=group_size), dtype=torch.float32)
        reward_time = time.perf_counter() - t1  # timed apart from generation: a slow verifier shows up as such
        stats = rollout_stats(rewards, rl, flat.truncated_frac, gen_time, reward_time)
        if custom:
            stats.update(multi_turn_stats(samples, float(flat.loss_mask.sum()), int(rl.sum())))
            stats.update(self._hook_stats)
        data = RolloutData(
            tokens=flat.tokens,
            total_lengths=flat.total_lengths,
            response_lengths=rl,
            rollout_log_probs=flat.log_probs,
            rewards=rewards,
            group_ids=torch.arange(num_groups).repeat_interleave(group_size),
            num_groups=num_groups,
            routed_experts=flat.routed_experts,
            pixel_values=flat.pixel_values,  # images (--multimodal-keys), None for text
            image_grid_thw=flat.image_grid_thw,
            image_counts=flat.image_counts,
            stats=stats,
            examples=[
                {"prompt": s.prompt, "response": s.response, "reward": float(r)} for s, r in zip(samples[:2], rewards)
            ],
            loss_mask=flat.loss_mask,
        )
        return data, samples

    def dispatch(self):
        """``generate_tokens``' way to the engines (``hooks.engine_dispatch``). Built per call: a
        Ray actor class with an ``async def`` method would become an async actor."""
        return engine_dispatch(self.fleet.engine, self.fleet.actors)

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (its config's), the bound of every id a hook returns."""
        if self._vocab_size is None:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(str(self.checkpoint_dir))  # a VL model's is its text config's
            self._vocab_size = int(config.get_text_config(decoder=True).vocab_size)
        return self._vocab_size

    @property
    def context_len(self) -> Optional[int]:
        """The model's context (``max_position_embeddings``; None when its config names none)."""
        if self._context_len is None:
            from rl_plugin.rollout.data.prompt_check import model_context_length

            self._context_len = model_context_length(self.checkpoint_dir)
        return self._context_len

    # -- one sample path: generate Samples, score them, flatten them --------------------------
    def _rollout(self, recs, n: int, *, seed: int) -> Tuple[RolloutData, List[Sample]]:
        """``n`` samples of each record (groups contiguous) from the generate function (the
        default one or the user's hook), scored and flattened; the samples come back too (the
        dynamic-sampling filter reads them)."""
        t0 = time.perf_counter()
        with abort.phase(f"generation on the {self.config.engine.engine} engine"):  # a hook names itself inside
            samples = self.generate_samples(recs, n, seed)
        custom = self.generate_hook is not None
        return self.assemble(samples, len(recs), time.perf_counter() - t0, custom=custom, who=self.describe())

    def _function_rollout(self, rollout_id: int, *, seed: int) -> RolloutData:
        """The whole rollout from ``--rollout-function-path``."""
        cfg, t0, fn = self.config, time.perf_counter(), self.rollout_fn
        source = DataSource(self.prompts.next_batch, self.tokenizer, cfg.n_samples_per_prompt)
        groups = run_rollout_function(
            fn,
            self.hook_args,
            rollout_id,
            source,
            self.dispatch(),
            seed,
            self.params,
            timeout=cfg.rollout_function_timeout,
            context_len=self.context_len,
            vocab_size=self.vocab_size,
            prompts=self.tokenizer,
        )
        samples = check_groups(groups, cfg.rollout_batch_size, cfg.n_samples_per_prompt, fn, rollout_id)
        checked = self._checked(samples, fn, cfg.n_samples_per_prompt)
        return self.assemble(checked, len(groups), time.perf_counter() - t0, custom=True, who=fn.describe())[0]

    def _checked(self, out: List[Any], hook: Hook, group_size: int) -> List[Sample]:
        """A hook's samples checked (``sample_check``: the contract, each its own object, cut to
        the limits, repeated groups counted), a response text it left empty (or that a cut
        emptied) decoded from every response id (tool output included)."""
        samples = check_samples(out, hook.describe(), self.vocab_size)
        check_distinct(samples, hook.describe(), group_size)
        self._hook_stats = hold_to_limits(samples, self.params.max_new_tokens, self.context_len)
        processor = getattr(self.tokenizer, "processor", None)
        if processor is not None:  # images: whole images only after a cut, tokens matching pixels (``vl_turns``)
            image_id, merge = processor.image_token_id, processor.image_processor.merge_size
            for s in samples:
                drop_cut_images(s, image_id, merge)
            check_image_tokens(samples, image_id, merge, hook.describe())
        repeated = duplicate_groups(samples, group_size)
        self._hook_stats["rollout/duplicate_groups"] = float(repeated)
        if repeated:
            say_once(
                "duplicate_groups",
                f"{hook.describe()} returned {repeated} group(s) whose samples repeat another group's tokens exactly; "
                "they train that prompt twice (counted in rollout/duplicate_groups)",
            )
        for s in samples:
            if not s.response:
                s.response = self.tokenizer.decode(s.tokens[len(s.tokens) - s.response_length :])
        return samples
