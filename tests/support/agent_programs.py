"""Agent programs for the agent-endpoint tests (``--custom-agent-function-path
tests.support.agent_programs:NAME``), written with the real ``openai`` client. Each records what
it received in ``SEEN`` (the tests run the rollout manager in their own process, so they read it).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import openai
from openai import AsyncOpenAI

SEEN = defaultdict(list)


def client(base_url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def chat(prompt):
    return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


async def two_turns(base_url, prompt, request_kwargs=None):
    """Append-only: the first answer as it came back, then a user turn."""
    c, msgs = client(base_url), chat(prompt)
    kw = {**(request_kwargs or {}), "max_tokens": 5}
    extra = {"return_prompt_token_ids": True}
    r1 = await c.chat.completions.create(model="m", messages=msgs, logprobs=True, extra_body=extra, **kw)
    msgs = msgs + [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And then?"}]
    r2 = await c.chat.completions.create(model="m", messages=msgs, logprobs=True, extra_body=extra, **kw)
    SEEN["two_turns"].append((base_url, prompt, r1, r2))


async def rewrite_history(base_url, prompt, request_kwargs=None):
    """Not append-only: the second request changes the first user turn."""
    c, msgs = client(base_url), chat(prompt)
    kw = {**(request_kwargs or {}), "max_tokens": 4}
    r1 = await c.chat.completions.create(model="m", messages=msgs, logprobs=True, **kw)
    edited = [{"role": "user", "content": "Forget that. What is 1+1?"}]
    r2 = await c.chat.completions.create(model="m", messages=edited, logprobs=True, **kw)
    SEEN["rewrite_history"].append((r1, r2))
    return 0.5  # the agent's reward wins


async def budget(base_url, prompt, request_kwargs=None):
    """Three turns of 6 tokens asked, 8 allowed per episode."""
    c, msgs, out = client(base_url), chat(prompt), []
    for _ in range(3):
        r = await c.chat.completions.create(model="m", messages=msgs, max_tokens=6, stop=["<|im_end|>"])
        out.append(r)
        msgs = msgs + [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "More."},
        ]
    SEEN["budget"].append(out)
    return {"reward": 1.0, "turns": 3}


async def completions(base_url, prompt, request_kwargs=None):
    """/v1/completions with token ids, then the same ids + the answer + more: one sample."""
    c = client(base_url)
    r1 = await c.completions.create(model="m", prompt=[1, 9, 10, 11], max_tokens=3, logprobs=1)
    ids = [1, 9, 10, 11] + r1.choices[0].token_ids + [12, 13]
    r2 = await c.completions.create(model="m", prompt=ids, max_tokens=3, logprobs=1)
    SEEN["completions"].append((r1, r2))


async def many(base_url, prompt, request_kwargs=None):
    """One short turn, then a second one after a random pause (64 of these run at once)."""
    c, msgs = client(base_url), chat(prompt)
    r1 = await c.chat.completions.create(model="m", messages=msgs, max_tokens=3)
    await asyncio.sleep(0.01 * (hash(base_url) % 5))
    msgs = msgs + [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "ok"}]
    r2 = await c.chat.completions.create(model="m", messages=msgs, max_tokens=3)
    SEEN["many"].append(r1.usage.completion_tokens + r2.usage.completion_tokens)


async def raises(base_url, prompt, request_kwargs=None):
    """The first episode raises; the others would wait a minute (they are cancelled at once)."""
    await client(base_url).chat.completions.create(model="m", messages=chat(prompt), max_tokens=2)
    SEEN["raises"].append(base_url)
    if len(SEEN["raises"]) > 1:
        await asyncio.sleep(60)
    raise KeyError("the tool's answer had no 'result'")


async def sleeps(base_url, prompt, request_kwargs=None):
    SEEN["sleeps"].append(base_url)
    await asyncio.sleep(60)


async def abort(args):
    SEEN["abort"].append(args is not None)


async def unused(base_url, prompt, request_kwargs=None):
    return 1.0


_ENDED = {}


async def refused(base_url, prompt, request_kwargs=None):
    """One completion each; the first episode then ends, and the second tries what must be refused."""
    c = client(base_url)
    await c.chat.completions.create(model="m", messages=chat(prompt), max_tokens=2)
    if not _ENDED:
        _ENDED["url"] = base_url
        return None
    await asyncio.sleep(0.05)  # the first episode has returned by now
    out = {}
    tries = {
        "ended": lambda: client(_ENDED["url"]).chat.completions.create(model="m", messages=chat(prompt), max_tokens=2),
        "unknown": lambda: client(base_url[:-6] + "ffffff").chat.completions.create(
            model="m", messages=chat(prompt), max_tokens=2
        ),
        "stream": lambda: c.chat.completions.create(model="m", messages=chat(prompt), stream=True),
        "stop": lambda: c.chat.completions.create(model="m", messages=chat(prompt), stop=["two tokens?"]),
        "greedy": lambda: c.chat.completions.create(model="m", messages=chat(prompt), temperature=0),
        "n": lambda: c.chat.completions.create(model="m", messages=chat(prompt), n=2),
        "top_logprobs": lambda: c.chat.completions.create(
            model="m", messages=chat(prompt), logprobs=True, top_logprobs=3
        ),
    }
    for name, call in tries.items():
        try:
            await call()
            out[name] = None
        except openai.APIStatusError as exc:
            out[name] = (exc.status_code, exc.body.get("param") if isinstance(exc.body, dict) else None, str(exc))
    SEEN["refused"].append(out)
    _ENDED.clear()


# -- issue 44: agents that block their event loop, hostile requests ------------------------------
def _post(url: str, body: bytes, timeout: float = 15.0):
    """A blocking POST (urllib): (status, parsed JSON answer)."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def sync_clients(base_url, prompt, request_kwargs=None):
    """Blocking HTTP inside `async def`: the synchronous openai client, then urllib."""
    import json

    c = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=15.0)
    r1 = c.chat.completions.create(model="m", messages=chat(prompt), max_tokens=3)
    body = json.dumps({"messages": chat(prompt), "max_tokens": 3}).encode()
    status, r2 = _post(base_url + "/v1/chat/completions", body)
    SEEN["sync_clients"].append((r1.usage.completion_tokens, status, r2["usage"]["completion_tokens"]))


async def blocks(base_url, prompt, request_kwargs=None):
    """One completion, then a synchronous sleep that blocks the agents' event loop."""
    import time

    await client(base_url).chat.completions.create(model="m", messages=chat(prompt), max_tokens=2)
    time.sleep(6)


async def hostile(base_url, prompt, request_kwargs=None):
    """Requests the endpoint must refuse with a 4xx, then one good completion (aiohttp)."""
    import json

    import aiohttp

    async def post(url: str, body: bytes):
        try:
            async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                return r.status, await r.json(content_type=None)
        except aiohttp.ClientError as exc:  # the server may close the connection after refusing
            return None, repr(exc)

    url = base_url + "/v1/completions"
    token, rest = base_url.split("/sessions/", 1)
    no_token = token.rsplit("/", 1)[0] + "/sessions/" + rest  # the same session without the run's token
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        out = {
            "oov_prompt": await post(url, json.dumps({"prompt": [1, 2, 1_000_000], "max_tokens": 2}).encode()),
            "oov_stop": await post(
                url, json.dumps({"prompt": [1, 2], "stop_token_ids": [999_999], "max_tokens": 2}).encode()
            ),
            "nested": await post(url, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
            "too_large": await post(url, json.dumps({"prompt": "x" * (9 * 1024 * 1024)}).encode()),
            "no_token": await post(
                no_token + "/v1/completions", json.dumps({"prompt": [1, 2], "max_tokens": 2}).encode()
            ),
            "ok": await post(url, json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()),
        }
    SEEN["hostile"].append(out)
    return 1.0


async def flood(base_url, prompt, request_kwargs=None):
    """200 concurrent requests on one session, each asking the whole budget."""
    c = client(base_url)
    outs = await asyncio.gather(
        *(c.chat.completions.create(model="m", messages=chat(prompt), max_tokens=8) for _ in range(200))
    )
    SEEN["flood"].append(sum(r.usage.completion_tokens for r in outs))
    return 1.0


async def rewardless(base_url, prompt, request_kwargs=None):
    """One completion, no reward: the run's reward (if any) scores the episode."""
    await client(base_url).chat.completions.create(model="m", messages=chat(prompt), max_tokens=2)
    SEEN["rewardless"].append(prompt)


async def scored(base_url, prompt, request_kwargs=None):
    """One completion; the agent's own reward."""
    await client(base_url).chat.completions.create(model="m", messages=chat(prompt), max_tokens=2)
    SEEN["scored"].append(prompt)
    return 0.25


async def image_in_turn_two(base_url, prompt, request_kwargs=None):
    """Images (``--multimodal-keys``): the prompt's chat as given (its image an ``image_url`` data URI),
    then a user turn holding a red 56 x 84 image as an ``image_url`` part (a tool's picture)."""
    from PIL import Image

    from rl_plugin.rollout.agent.images import data_uri

    c, msgs = client(base_url), chat(prompt)
    kw = {**(request_kwargs or {}), "max_tokens": 3}
    extra = {"return_prompt_token_ids": True}
    r1 = await c.chat.completions.create(model="m", messages=msgs, logprobs=True, extra_body=extra, **kw)
    red = data_uri(Image.new("RGB", (56, 84), (255, 0, 0)))
    tool = [{"type": "image_url", "image_url": {"url": red}}, {"type": "text", "text": "colour?"}]
    msgs = msgs + [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": tool}]
    r2 = await c.chat.completions.create(model="m", messages=msgs, logprobs=True, extra_body=extra, **kw)
    SEEN["image_in_turn_two"].append((prompt, r1, r2))
    return 1.0
