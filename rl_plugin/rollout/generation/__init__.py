"""RL generation: the default generate function (``default.py``: one engine call per engine), the
user hooks (``hooks.py``: ``--custom-generate-function-path``, ``--rollout-function-path``) and the
source that makes one rollout from them, scored and flattened (``source.py``)."""
