"""LossConfig: the loss core's settings, declared as the flags they are (``rl_plugin.flags``) and
built once from the parsed (and validated) flags. A foundation below the loss core (which
re-exports it as ``rl_plugin.loss.LossConfig``), so the flag layer reads it without importing
torch or the loss core.

One flat object (custom TIS functions read slime's names off it), composed of its parts, each
with its flags and rules: ``aggregation`` (the mode, resolved once), ``policy`` (estimator,
clipping, KL, entropy, metrics), ``logprobs`` (temperature, layout, chunking) and ``offpolicy``
(importance sampling, DeepSpeed parity), ``loss_type`` (the policy loss or SFT's NLL) and ``opd`` (on-policy distillation). User functions named by flags (custom reducer, custom
TIS) are loaded when the config is built, in the process that builds it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rl_plugin.flags import Declared
from rl_plugin.loss_config.aggregation import AggregationSettings, load_reducer, resolved_mode
from rl_plugin.loss_config.logprobs import LogProbSettings
from rl_plugin.loss_config.loss_type import LossTypeSettings
from rl_plugin.loss_config.offpolicy import OffPolicySettings, load_tis_function
from rl_plugin.loss_config.opd import OpdSettings
from rl_plugin.loss_config.policy import GROUP_RELATIVE, PolicySettings

PARTS = (AggregationSettings, PolicySettings, LogProbSettings, OffPolicySettings, LossTypeSettings, OpdSettings)


@dataclass(frozen=True)
class LossConfig(
    OpdSettings, LossTypeSettings, OffPolicySettings, LogProbSettings, PolicySettings, AggregationSettings, Declared
):
    """The loss core's settings (fields in ``PARTS`` order)."""

    GROUP_RELATIVE = GROUP_RELATIVE  # estimators whose baseline is the prompt group (the batching rules read it)

    def with_user_functions(self) -> "LossConfig":
        """This config with the user functions its flags name loaded (in the calling process)."""
        return replace(
            self,
            custom_pg_reducer=load_reducer(self.custom_pg_loss_reducer_function_path),
            custom_tis_function=load_tis_function(self.custom_tis_function_path),
        )

    @staticmethod
    def resolved_mode(args) -> str:
        """The aggregation mode the flags ask for (a pure function of the flags as given)."""
        return resolved_mode(args)

    def check(self, run) -> None:
        for part in PARTS:
            part.check(self, run)
