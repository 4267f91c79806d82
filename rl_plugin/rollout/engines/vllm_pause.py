"""Partial rollouts on vLLM (``--fully-async``): a generation driven step by step, paused at a token
boundary for a weight load (``engines.pause.GenerationGate``).

vLLM 0.32's CPU build has no pause API for its offline ``LLM`` (``LLM.sleep`` aborts or waits for
the requests in flight), so the call drives the engine itself: every request is added with
``RequestOutputKind.CUMULATIVE``, ``llm_engine.step()`` runs one scheduler step (one token per
running request), and between two steps the gate is offered. When the weight version changed
there, ``retract`` aborts the unfinished requests and adds each again with its prompt + the tokens
it generated so far as the prompt and the tokens left as ``max_tokens`` (vLLM prefills them again
under the new weights, salted by the new weights' ``cache_salt`` so no old block is reused: every
later log-prob is the new weights' own); ``in_place`` lets them run on (their KV blocks were
computed by the old weights). Each token keeps the version of the step that
drew it. A resubmitted request is seeded ``sample_seed(seed, i) + attempt``: its continuation is a
fresh stream, as any sample drawn by other weights is. ``on_done`` (``--rollout-submission-granularity
sample``, the gate's ``on_generations_done``) gets the requests that finished at each boundary, before
the gate is offered, so their groups can leave before the call's longest request ends.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, List, Optional, Sequence, Tuple

Result = Tuple[List[int], List[float], List[int], bool]  # ids, log-probs, versions, stopped on a stop id


def generate_pausable(
    llm,
    prompts: Sequence[List[int]],
    sampling: Sequence,
    gate,
    seed_of: Callable[[int], int],
    lora_of: Optional[Callable[[], Any]] = None,
    salt_of: Optional[Callable[[], str]] = None,
    on_done: Optional[Callable[[List[int], List[Result]], None]] = None,
    request_of: Optional[Callable[[int, List[int]], dict]] = None,
):
    """One ``Result`` per prompt (``sampling[i]`` its vLLM ``SamplingParams``), paused by ``gate``.
    ``lora_of()`` (LoRA runs) is the ``LoRARequest`` of the newest adapters, asked at every
    (re)submission: a retracted request continues under the adapters of the new version.
    ``salt_of()`` is the prefix-cache salt of the weights held now (``VLLMEngine.cache_salt``), asked
    at every (re)submission too: a re-added "prompt + tokens so far" never hits a block of the old
    weights (``in_place`` requests keep their own blocks: they are not re-added).
    ``on_done(indices, results)``: the requests finished since the last boundary, at each boundary
    while others still run (each reported once; the ones finished at the last step are not: the
    call returns them). A finished request's lists are never touched again. ``request_of(i, ids so
    far)``: the request of prompt ``i`` (salt included) where it is more than its ids (images:
    ``vllm_images.request``)."""
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    n = len(prompts)
    ids: List[List[int]] = [[] for _ in range(n)]
    lps: List[List[float]] = [[] for _ in range(n)]
    vers: List[List[int]] = [[] for _ in range(n)]
    base = [0] * n  # tokens generated before the request now running was added
    done, stopped = [False] * n, [False] * n
    attempt = [0] * n

    def add(i: int) -> None:
        left = int(sampling[i].max_tokens) - len(ids[i])
        if left <= 0:
            done[i] = True
            return
        sp = copy.copy(sampling[i])
        sp.max_tokens, sp.output_kind = left, RequestOutputKind.CUMULATIVE
        sp.seed = (seed_of(i) + attempt[i]) % (2**63)
        base[i] = len(ids[i])
        lora = None if lora_of is None else lora_of()
        if request_of is not None:
            prompt = request_of(i, ids[i])
        else:
            prompt = {"prompt_token_ids": list(prompts[i]) + ids[i]}
            if salt_of is not None:
                prompt["cache_salt"] = salt_of()
        engine.add_request(f"p{i}a{attempt[i]}", prompt, sp, lora_request=lora)

    version = gate.enter()
    try:
        for i in range(n):
            add(i)
        while engine.has_unfinished_requests():
            finished: List[int] = []  # this step's
            for out in engine.step():
                i, a = (int(x) for x in out.request_id.split("-")[0][1:].split("a"))
                if a != attempt[i] or done[i]:
                    continue  # an aborted request's last output
                c = out.outputs[0]
                new = list(c.token_ids)[len(ids[i]) - base[i] :]
                steps = list(c.logprobs)[len(ids[i]) - base[i] :]
                ids[i] += new
                lps[i] += [float(step[t].logprob) for step, t in zip(steps, new)]
                vers[i] += [version] * len(new)
                if out.finished:
                    done[i], stopped[i] = True, c.finish_reason == "stop"
                    finished.append(i)
            if on_done is not None and finished and engine.has_unfinished_requests():
                on_done(finished, [(ids[i], lps[i], vers[i], stopped[i]) for i in finished])
            now = gate.boundary()
            if now != version and gate.mode == "retract":
                live = [i for i in range(n) if not done[i]]
                engine.abort_request([f"p{i}a{attempt[i]}" for i in live], internal=False)
                for i in live:
                    attempt[i] += 1
                    add(i)
            version = now
    finally:
        gate.leave()
    return [(ids[i], lps[i], vers[i], stopped[i]) for i in range(n)]
