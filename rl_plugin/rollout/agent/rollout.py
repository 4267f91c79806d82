"""A rollout of ``--custom-agent-function-path``: every sample is one agent episode.

For each sample (``--n-samples-per-prompt`` per prompt, groups contiguous) a session is opened
(``sessions``) and the agent is called, miles' signature::

    async def run_agent(base_url, prompt, request_kwargs=None) -> None | float | dict

with ``base_url`` the session's (``server.AgentServer.base_url``: the run's token and the
session's id in it), ``prompt`` the dataset's prompt as it is (a string or a list of chat
messages; messages need no ``--apply-chat-template``: the endpoint renders every chat with the
checkpoint's template, and ``sample.prompt`` is that rendering, ``template.AgentPrompts``) and
``request_kwargs`` the run's sampling (``temperature``, ``top_p``, ``max_tokens``). All episodes
run concurrently in one event loop of their own, in a thread of its own (``rl_plugin-agents``),
each within ``--agent-timeout`` seconds; the endpoint runs in another (``server``). The recorded
completions become samples (``records.episode_samples``); the episode's reward is the agent's
return value when it is a number or a dict (holding the number under ``--reward-key``), else the
run's reward (``rewards.scorer``, every form) on the episode's final conversation:
``sample.prompt`` the prompt as the plain path shows it, ``sample.response`` every token after it
(tool output included), ``sample.metadata["messages"]`` the last chat request's messages plus the
answer. Every sample of an episode carries its reward; their group is the prompt's. With no
reward configured (``--rm-type`` / ``--custom-rm-path``), an agent that returns None stops the
rollout naming the sample (``AgentError``).

Failures stop the rollout with a named error (``AgentError``), never a hang: an agent that
raises (``AgentRaisedError``), runs past ``--agent-timeout`` (``AgentTimeoutError``: cancelled, its
session answers 409 from then on) or returns without one completion (``AgentSessionUnusedError``);
an engine (or endpoint) failure while serving a request (``AgentEndpointError``, whatever the
agent did with its 500). An agent that blocks the agents' event loop (``time.sleep``, a
synchronous HTTP client inside ``async def``) cannot be cancelled: the calling thread watches
the loop and, ``LOOP_GRACE_S`` past the deadline, stops the rollout with ``AgentTimeoutError``
naming the sample and the agent's file:line where it blocks (from the loop thread's stack); that
thread is left behind, its sessions answering 409. Every class name ends in ``Error``: the
driver shows a remote error by its last ``...Error:`` line (``ray.rollout_actor.error_line``). On
such a failure (or an abort) the module's optional ``async def abort(args)`` is called once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import linecache
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from rl_plugin.configs.custom_generation import DEFAULT_AGENT_TIMEOUT_S
from rl_plugin.rollout import abort as aborting
from rl_plugin.rollout.agent.images import ChatImages, agent_prompt
from rl_plugin.rollout.agent.records import episode_samples, episode_stats
from rl_plugin.rollout.agent.server import AgentServer
from rl_plugin.rollout.agent.serving import Serving
from rl_plugin.rollout.agent.sessions import Session, SessionTable
from rl_plugin.rollout.agent.template import AgentPrompts, ChatTemplate
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
# How long past --agent-timeout (or an abort request) the agents' event loop may stay without
# ending the rollout before it counts as blocked by an agent: a live loop ends every episode at
# its deadline (cancelling the others takes milliseconds).
LOOP_GRACE_S = 2.0
POLL_S = 0.05  # the calling thread's wait between two looks at the deadline and the abort request
BLOCKING_FIX = (
    "a synchronous call inside `async def run_agent` (time.sleep, requests, the synchronous openai client) stops "
    "every episode of the rollout and every deadline. Fix: await the asynchronous forms (asyncio.sleep, "
    "openai.AsyncOpenAI, aiohttp / httpx.AsyncClient), or run the blocking call in a thread: "
    "`await asyncio.to_thread(fn, ...)`"
)


class AgentError(RuntimeError):
    """An agent episode failed; the message names the agent, its file:line and the sample."""


class AgentRaisedError(AgentError):
    pass


class AgentTimeoutError(AgentError):
    pass


class AgentSessionUnusedError(AgentError):
    pass


class AgentEndpointError(AgentError):
    """The engine (or the endpoint) failed serving an agent's request; not the agent's fault."""


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
        # with images: the processor's prompts (``VLPrompts``) and the endpoint's image_url parts
        self.images = ChatImages(tokenizer) if getattr(tokenizer, "processor", None) is not None else None
        self.prompts = tokenizer if self.images is not None else AgentPrompts(tokenizer)
        self.server = AgentServer(host) if host else AgentServer()
        self.timeout = float(config.agent_timeout) if config.agent_timeout is not None else DEFAULT_AGENT_TIMEOUT_S
        self.engine_calls = 0

    def describe(self) -> str:
        return f"{AGENT_FLAG} {self.spec} ({getattr(self.fn, '__qualname__', '?')} at {where(self.fn)})"

    def source(self) -> Optional[str]:
        try:
            return inspect.getsourcefile(inspect.unwrap(self.fn))
        except TypeError:
            return None

    def request_kwargs(self, params: SamplingParams) -> Dict[str, Any]:
        return {"temperature": params.temperature, "top_p": params.top_p, "max_tokens": int(params.max_new_tokens)}

    async def _agent_call(self, i: int, session: Session, prompt, kwargs: Dict[str, Any]) -> Any:
        """The agent on episode ``i``; its frame on the loop thread's stack names ``i``
        (``_blocked``)."""
        return await self.fn(self.server.base_url(session.sid), prompt, dict(kwargs))

    async def _episode(self, i: int, session: Session, prompt, kwargs: Dict[str, Any], seconds: List[float]) -> Any:
        timeout, t0 = self.timeout, time.perf_counter()
        where_ = describe_sample(session.base, i)
        try:
            out = await asyncio.wait_for(self._agent_call(i, session, prompt, kwargs), timeout)
        except asyncio.TimeoutError:
            session.end(f"--agent-timeout {timeout:g} s")
            raise AgentTimeoutError(
                f"{self.describe()} did not return within --agent-timeout {timeout:g} s on {where_} "
                f"({len(session.records)} completions served). Fix: give the agent's tools their own timeouts, or "
                "raise --agent-timeout"
            ) from None
        except asyncio.CancelledError:
            session.end("cancelled")
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised naming the agent and the sample
            session.end("the agent raised")
            raise AgentRaisedError(
                f"{self.describe()} raised on {where_}: {describe_exception(exc, self.source())}"
            ) from exc
        finally:
            seconds[i] = time.perf_counter() - t0
        session.end("the agent returned")
        if not session.records:
            raise AgentSessionUnusedError(
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

    async def _all(self, sessions: List[Session], prompts, kwargs: Dict[str, Any], seconds):
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
            return [t.result() for t in tasks]
        finally:
            for t in tasks:
                t.cancel()

    def _episodes(self, sessions: List[Session], prompts, kwargs: Dict[str, Any], seconds) -> List[Any]:
        """Every episode in the agents' thread and loop, watched from this thread (module
        docstring): the agents' rewards, or the first failure."""
        result: concurrent.futures.Future = concurrent.futures.Future()
        held: Dict[str, Any] = {}

        async def main():
            held["loop"], held["task"] = asyncio.get_running_loop(), asyncio.current_task()
            return await self._all(sessions, prompts, kwargs, seconds)

        def target():
            try:
                result.set_result(asyncio.run(main()))
            except BaseException as exc:  # noqa: BLE001 - handed to the watching thread
                result.set_exception(exc)

        def stop(why: str) -> None:
            for s in sessions:
                s.end(why)
            if "task" in held:
                held["loop"].call_soon_threadsafe(held["task"].cancel)

        thread = threading.Thread(target=target, name="rl_plugin-agents", daemon=True)
        deadline, aborted = time.monotonic() + self.timeout + LOOP_GRACE_S, None
        thread.start()
        while True:
            try:
                return result.result(timeout=POLL_S)
            except concurrent.futures.TimeoutError:
                pass
            except (asyncio.CancelledError, concurrent.futures.CancelledError):
                raise aborting.GenerationAborted(f"aborted on request during the agent {self.describe()}") from None
            now = time.monotonic()
            if aborting.requested() and aborted is None:
                aborted = now
                stop("the rollout was aborted")
            if aborted is not None and now > aborted + LOOP_GRACE_S:
                raise aborting.GenerationAborted(
                    f"aborted on request during the agent {self.describe()} (its event loop was blocked)"
                )
            if now > deadline:
                error = self._blocked(thread, sessions)
                stop("--agent-timeout: the agents' event loop was blocked")
                raise error

    def _blocked(self, thread: threading.Thread, sessions: Sequence[Session]) -> AgentTimeoutError:
        """The error of a loop blocked past the deadline: the episode and the agent's file:line
        where the loop thread is, read from its stack."""
        frame, episode, spot = sys._current_frames().get(thread.ident), None, None
        source, mine = self.source(), AgentRollout._agent_call.__code__
        while frame is not None:
            if frame.f_code is mine and episode is None:
                episode = frame.f_locals.get("i")
            if spot is None and source is not None and frame.f_code.co_filename == source:
                code = linecache.getline(source, frame.f_lineno).strip()
                spot = f"{source}:{frame.f_lineno}" + (f" (`{code}`)" if code else "")
            frame = frame.f_back
        which = (
            describe_sample(sessions[episode].base, episode)
            if isinstance(episode, int)
            else f"one of samples {[i for i, s in enumerate(sessions) if s.ended is None][:8]}"
        )
        return AgentTimeoutError(
            f"{self.describe()} did not return within --agent-timeout {self.timeout:g} s on {which}: it blocks the "
            f"agents' event loop{f' at {spot}' if spot else ''}; {BLOCKING_FIX}"
        )

    def _agent_prompt(self, rec, base):
        """What the agent gets: the record's prompt; with images, chat messages holding them as
        ``image_url`` data URIs (``images.agent_prompt``)."""
        shown = (base.multimodal_inputs or {}).get("image")
        return rec.prompt if not shown else agent_prompt(self.prompts, rec.prompt, shown)

    def run(
        self,
        recs,
        n: int,
        seed: int,
        dispatch: Dispatch,
        defaults: SamplingParams,
        context_len,
        version=None,
        vocab_size: Optional[int] = None,
    ) -> tuple:
        """Every episode of ``recs`` x ``n`` (module docstring): ``(sessions, agent rewards,
        seconds, rejected requests)``."""
        bases = fresh_samples(self.prompts, recs, n)
        prompts = [self._agent_prompt(recs[i // n], bases[i]) for i in range(len(bases))]
        table, seconds = SessionTable(), [0.0] * len(bases)
        router = EngineRouter(dispatch, seed, defaults, context_len, vocab_size=vocab_size)
        serving = Serving(table, router, self.template, version, vocab_size, images=self.images)
        sessions = [table.open(b, defaults.max_new_tokens) for b in bases]
        try:
            with self.server.serving(serving):
                try:
                    rewards = self._episodes(sessions, prompts, self.request_kwargs(defaults), seconds)
                except AgentError as exc:  # the engine's failure, when there was one, is the cause
                    failure = self._endpoint_error(serving, sessions)
                    if failure is None:
                        raise
                    raise failure from exc
                failure = self._endpoint_error(serving, sessions)
                if failure is not None:
                    raise failure
        except (AgentError, aborting.GenerationAborted):
            self._call_abort()
            raise
        self.engine_calls = router.calls
        return sessions, rewards, seconds, table.rejected

    def _endpoint_error(self, serving: Serving, sessions: Sequence[Session]) -> Optional[AgentEndpointError]:
        """The first failure the endpoint answered 500, as the rollout's error (None: none)."""
        if serving.failure is None:
            return None
        exc, session = serving.failure
        i = sessions.index(session)
        return AgentEndpointError(
            f"the engine failed serving a request of {self.describe()} on {describe_sample(session.base, i)} "
            f"(answered 500): {type(exc).__name__}: {exc}"
        )

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
        self,
        recs,
        n: int,
        seed: int,
        dispatch: Dispatch,
        defaults,
        context_len,
        scorer,
        version=None,
        vocab_size: Optional[int] = None,
    ) -> RolloutData:
        """One rollout of episodes, scored and flattened (module docstring); ``vocab_size`` bounds
        the ids a request may name (``serving.check_vocab``)."""
        t0 = time.perf_counter()
        sessions, agent_rewards, seconds, rejected = self.run(
            recs, n, seed, dispatch, defaults, context_len, version, vocab_size
        )
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
            pixel_values=flat.pixel_values,  # images (--multimodal-keys, ``images``), None for text
            image_grid_thw=flat.image_grid_thw,
            image_counts=flat.image_counts,
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
        unscored = next((i for i, r in enumerate(agent_rewards) if r is None), None)
        if unscored is not None and not scorer.configured:
            raise AgentError(
                f"{self.describe()} returned None on {describe_sample(sessions[unscored].base, unscored)} and the run "
                "has no reward to score the episode with (no --rm-type, no --custom-rm-path). Fix: return the reward "
                "from run_agent (a number, or a dict holding it under --reward-key), or pass --custom-rm-path / "
                "--rm-type to score the episodes the agent leaves unscored"
            )
        if unscored is not None:
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
