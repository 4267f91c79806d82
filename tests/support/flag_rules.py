"""The check every flag-rule table runs: the flags are refused at parse time with a message that
names them, states the rule and gives the fix (``Fix:``)."""

from __future__ import annotations

from typing import Sequence

import pytest

from rl_plugin.arguments import RLArgumentError, parse_args


def assert_refused(flags: str, fragments: Sequence[str]) -> None:
    with pytest.raises(RLArgumentError) as err:
        parse_args(flags.split())
    message = str(err.value)
    assert "Fix:" in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
