"""The run config a placement test builds: the parser's defaults with a two-node, two-GPU-per-node,
TP=2 colocated hf run, and ``kw`` (flag dests) on top, as the run builds it (``RunConfig.from_args``)."""

from __future__ import annotations

from types import SimpleNamespace


def placement_config(**kw):
    """The run config of the parser's defaults with ``kw`` (flag dests) set, as the run builds it."""
    from rl_plugin.arguments import build_parser
    from rl_plugin.configs.run import RunConfig

    base = dict(
        actor_num_nodes=2,
        actor_num_gpus_per_node=2,
        colocate=True,
        rollout_engine="hf",
        rollout_num_gpus=None,
        rollout_num_gpus_per_engine=1,
        tensor_model_parallel_size=2,
        context_parallel_size=1,
        placement_device="auto",
        update_weight_transport="auto",
        loss_type="policy_loss",
        fully_async=False,
        max_weight_staleness=0,
        hf_checkpoint=None,
    )
    base.update(kw)
    return RunConfig.from_args(SimpleNamespace(**{**vars(build_parser().parse_args([])), **base}))
