"""The marker of Megatron-LM's own flags: declared on our configs, added to our parser only when
Megatron-LM's is absent (as its ``extra_args_provider`` we read its values)."""

MEGATRON = dict(group="megatron", megatron=True)
