"""Agent sessions (``--custom-agent-function-path``): an OpenAI-compatible endpoint that an
unmodified agent program drives, token in / token out.

- ``server``: the aiohttp endpoint (one port per run, on loopback, in its own thread and event
  loop, behind the run's token);
- ``serving``: one rollout's requests: checked, rendered, generated within the episode's budget;
- ``sessions``: one session per sample, its records and the append-only rule;
- ``chat``: the OpenAI request / answer formats, tool-call parsing;
- ``template``: the model's chat template and tokenizer as the endpoint uses them;
- ``records``: the recorded completions and the samples they become;
- ``rollout``: a rollout of agent episodes, scored and flattened (``AgentRollout``).
"""
