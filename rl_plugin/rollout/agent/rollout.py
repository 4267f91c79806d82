"""A rollout of ``--custom-agent-function-path``: every sample is one agent episode.

For each sample (``--n-samples-per-prompt`` per prompt, groups contiguous) a session is opened
(``sessions``) and the agent is called, miles' signature::

    async def run_agent(base_url, prompt, request_kwargs=None) -> None | float | dict

with ``base_url`` the session's (``server.AgentServer.base_url``), ``prompt`` the dataset's prompt
as it is (a string or a list of chat messages) and ``request_kwargs`` the run's sampling
(``temperature``, ``top_p``, ``max_tokens``). All episodes run concurrently in the rollout's event
loop, each within ``--agent-timeout`` seconds. The recorded completions become samples
(``records.episode_samples``); the episode's reward is the agent's return value when it is a
number or a dict (holding the number under ``--reward-key``), else the run's reward
(``rewards.scorer``, every form) on the episode's final conversation: ``sample.prompt`` the
prompt as the plain path shows it, ``sample.response`` every token after it (tool output
included), ``sample.metadata["messages"]`` the last chat request's messages plus the answer. Every
sample of an episode carries its reward; their group is the prompt's.

Failures stop the rollout with a named error (``AgentError``), never a hang: an agent that
raises (``AgentRaised``), runs past ``--agent-timeout`` (``AgentTimeout``: cancelled, its session
answers 409 from then on) or returns without one completion (``AgentSessionUnused``). On such a
failure (or an abort) the module's optional ``async def abort(args)`` is called once.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from rl_plugin.rollout import abort as aborting
from rl_plugin.rollout.agent.records import episode_samples, episode_stats
from rl_plugin.rollout.agent.server import AgentServer, Serving
from rl_plugin.rollout.agent.sessions import Session, SessionTable
from rl_plugin.rollout.agent.template import ChatTemplate
from rl_plugin.rollout.deadlines import is_async_callable
from rl_plugin.rollout.engines.base import SamplingParams
from rl_plugin.rollout.flatten import flatten_samples, rollout_stats
from rl_plugin.rollout.generate import Dispatch, EngineRouter
from rl_plugin.rollout.generation.hooks import fresh_samples
from rl_plugin.rollout.rewards.functions import reward_number
from rl_plugin.rollout.sample import RolloutData
from rl_plugin.rollout.sample_check import check_log_probs, check_trainable, describe_sample
from rl_plugin.user_code import describe_exception, load_function, where

AGENT_FLAG = "--custom-agent-function-path"
ABORT_TIMEOUT_S = 30.0


class AgentError(RuntimeError):
    """An agent episode failed; the message names the agent, its file:line and the sample."""


class AgentRaised(AgentError):
    pass


class AgentTimeout(AgentError):
    pass


class AgentSessionUnused(AgentError):
    pass


def _reward_of(value: Any, key: str) -> Optional[Any]:
    """The agent's return value as a reward (a number or a dict), or None (the run's reward)."""
    if value is None:
        return None
    if isinstance(value, dict):
        reward_number(value[key])
        return value
    return reward_number(value)


class AgentRollout:
    """The agent, its endpoint and the rollout that runs them (module docstring)."""

    def __init__(self, spec: str, tokenizer, config, hook_args, host: Optional[str] = None):
        self.spec, self.config, self.hook_args, self.tokenizer = spec, config, hook_args, tokenizer
        self.fn = load_function(spec, AGENT_FLAG)
        if not is_async_callable(self.fn):
            raise ValueError(
                f"{AGENT_FLAG} {spec}: {getattr(self.fn, '__qualname__', self.fn)} at {where(self.fn)} is not an async "
                "function; the agent is miles' `async def run_agent(base_url, prompt, request_kwargs=None)`"
            )
        module = sys.modules.get(getattr(self.fn, "__module__", ""), None)
        self.abort_fn: Optional[Callable] = getattr(module, "abort", None) if module is not None else None
        tok = getattr(tokenizer, "tok", None)
        if tok is None:
            raise ValueError(
                f"{AGENT_FLAG}: the checkpoint has a character tokenizer; the agent endpoint renders chats with a Hugging "
                "Face tokenizer's chat template (use a checkpoint that has one)"
            )
        self.template = ChatTemplate(tok, config.apply_chat_template_kwargs)
        self.server = AgentServer(host)
        self.engine_calls = 0

    def describe(self) -> str:
        return f"{AGENT_FLAG} {self.spec} ({getattr(self.fn, '__qualname__', '?')} at {where(self.fn)})"

    def request_kwargs(self, params: SamplingParams) -> Dict[str, Any]:
        return {"temperature": params.temperature, "top_p": params.top_p, "max_tokens": int(params.max_new_tokens)}

    async def _episode(self, i: int, session: Session, prompt, kwargs: Dict[str, Any], seconds: List[float]) -> Any:
        timeout, t0 = self.config.agent_timeout, time.perf_counter()
        where_ = describe_sample(session.base, i)
        try:
            out = await asyncio.wait_for(self.fn(self.server.base_url(session.sid), prompt, dict(kwargs)), timeout)
        except asyncio.TimeoutError:
            session.end(f"--agent-timeout {timeout:g} s")
            raise AgentTimeout(
                f"{self.describe()} did not return within --agent-timeout {timeout:g} s on {where_} "
                f"({len(session.records)} completions served). Fix: give the agent's tools their own timeouts, or "
                "raise --agent-timeout"
            ) from None
        except asyncio.CancelledError:
            session.end("cancelled")
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised naming the agent and the sample
            session.end("the agent raised")
            raise AgentRaised(
                f"{self.describe()} raised on {where_}: {describe_exception(exc, inspect.getsourcefile(self.fn))}"
            ) from exc
        finally:
            seconds[i] = time.perf_counter() - t0
        session.end("the agent returned")
        if not session.records:
            raise AgentSessionUnused(
                f"{self.describe()} returned on {where_} without one completion from its session; an episode is what "
                "the model generates: call base_url + '/v1/chat/completions' at least once"
            )
        try:
            return _reward_of(out, self.config.reward_key or "reward")
        except (TypeError, ValueError, KeyError) as exc:
            raise AgentError(
                f"{self.describe()} returned {out!r} on {where_}: an agent returns None (the run's reward scores the "
                f"episode), a number, or a dict holding it under --reward-key ({exc!r})"
            ) from None

    async def _all(self, bases, prompts, router: EngineRouter, table: SessionTable, seconds, version):
        kwargs = self.request_kwargs(router.defaults)
        sessions = [table.open(b, router.defaults.max_new_tokens) for b in bases]
        async with self.server.serving(Serving(table, router, self.template, version)):
            tasks = [
                asyncio.ensure_future(self._episode(i, s, p, kwargs, seconds))
                for i, (s, p) in enumerate(zip(sessions, prompts))
            ]
            try:
                done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                failed = next((t for t in tasks if t in done and t.exception() is not None), None)
                for t in pending:  # the first failure stops the rollout: the other episodes are cancelled
                    t.cancel()
                if pending:
                    await asyncio.gather(*pending, return_exceptions=True)
                if failed is not None:
                    raise failed.exception()
                return sessions, [t.result() for t in tasks]
            finally:
                for t in tasks:
                    t.cancel()

    def run(
        self, recs, n: int, seed: int, dispatch: Dispatch, defaults: SamplingParams, context_len, version=None
    ) -> tuple:
        """Every episode of ``recs`` x ``n`` (module docstring): ``(sessions, agent rewards,
        seconds, rejected requests)``."""
        bases = fresh_samples(self.tokenizer, recs, n)
        prompts = [recs[i // n].prompt for i in range(len(bases))]
        table, seconds = SessionTable(), [0.0] * len(bases)
        router = EngineRouter(dispatch, seed, defaults, context_len)

        async def main():
            router.bind()
            return await self._all(bases, prompts, router, table, seconds, version)

        try:
            sessions, rewards = aborting.run(main(), f"the agent {self.describe()}")
        except (AgentError, aborting.GenerationAborted):
            self._call_abort()
            raise
        self.engine_calls = router.calls
        return sessions, rewards, seconds, table.rejected

    def _call_abort(self) -> None:
        if self.abort_fn is None:
            return
        try:
            out = self.abort_fn(self.hook_args)
            if inspect.isawaitable(out):
                asyncio.run(asyncio.wait_for(out, ABORT_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - the rollout's own error is the one to report
            print(f"warning: the agent's abort(args) raised {type(exc).__name__}: {exc}", flush=True)

    def rollout(
        self, recs, n: int, seed: int, dispatch: Dispatch, defaults, context_len, scorer, version=None
    ) -> RolloutData:
        """One rollout of episodes, scored and flattened (module docstring)."""
        t0 = time.perf_counter()
        sessions, agent_rewards, seconds, rejected = self.run(recs, n, seed, dispatch, defaults, context_len, version)
        samples, owner = [], []
        for e, s in enumerate(sessions):
            for sample in episode_samples(s.records, s.base):
                samples.append(sample)
                owner.append(e)
        gen_time = time.perf_counter() - t0
        flat = flatten_samples(samples)
        rl = flat.response_lengths
        check_log_probs(flat.log_probs, flat.loss_mask, rl, samples, self.describe())
        check_trainable(flat.loss_mask, self.describe(), len(samples))
        t1 = time.perf_counter()
        episode_rewards = self._score(sessions, agent_rewards, scorer, n)
        reward_time = time.perf_counter() - t1
        for sample, e in zip(samples, owner):
            sample.reward = sessions[e].base.reward
            sample.response = self.tokenizer.decode(sample.tokens[sample.prompt_length :])
        per_sample = torch.tensor([episode_rewards[e] for e in owner], dtype=torch.float32)
        stats = rollout_stats(
            torch.tensor(episode_rewards, dtype=torch.float32), rl, flat.truncated_frac, gen_time, reward_time
        )
        mask_sum, resp = float(flat.loss_mask.sum()), int(rl.sum())
        stats.update(episode_stats([s.records for s in sessions], seconds))
        stats["agent/masked_token_frac"] = 1.0 - mask_sum / max(resp, 1)
        stats["agent/model_tokens"] = mask_sum
        stats["agent/samples"] = float(len(samples))
        stats["agent/rejected_requests"] = float(rejected)
        stats["agent/engine_calls"] = float(self.engine_calls)  # batched: fewer than agent/calls
        owner_t = torch.tensor(owner, dtype=torch.long)
        return RolloutData(
            tokens=flat.tokens,
            total_lengths=flat.total_lengths,
            response_lengths=rl,
            rollout_log_probs=flat.log_probs,
            rewards=per_sample,
            group_ids=torch.div(owner_t, n, rounding_mode="floor"),
            num_groups=len(recs),
            stats=stats,
            examples=[
                {"prompt": s.prompt, "response": s.response, "reward": float(r)}
                for s, r in zip(samples[:2], per_sample)
            ],
            loss_mask=flat.loss_mask,
        )

    def _score(self, sessions: Sequence[Session], agent_rewards: Sequence[Any], scorer, n: int) -> List[float]:
        """Each episode's reward: the agent's, else the run's reward on its final conversation
        (its last sample, ``metadata["messages"]`` the last chat). The run's reward is called only
        when some episode needs it, on every episode (a group reward sees whole groups)."""
        finals = []
        for s in sessions:
            last = episode_samples(s.records, s.base)[-1]
            last.response = self.tokenizer.decode(last.tokens[last.prompt_length :])
            last.metadata = {**last.metadata, "messages": s.last_messages}
            finals.append(last)
        out: List[float] = [0.0] * len(sessions)
        if any(r is None for r in agent_rewards):
            scored = scorer.score_samples(finals, group_size=n)
            for i, r in enumerate(agent_rewards):
                if r is None:
                    out[i], sessions[i].base.reward = float(scored[i]), finals[i].reward
        key = self.config.reward_key or "reward"
        for i, r in enumerate(agent_rewards):
            if r is not None:
                sessions[i].base.reward = r
                out[i] = reward_number(r[key]) if isinstance(r, dict) else float(r)
        return out
