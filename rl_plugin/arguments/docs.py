"""Generate ``arguments.md`` from the parser, so the flag reference cannot drift.

``python -m rl_plugin.arguments.docs`` rewrites the file; ``python -m rl_plugin.arguments.docs
--check`` exits 1 if it is stale. tests/fast/arguments/test_arguments.py runs the check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rl_plugin.arguments import build_parser

DOC_PATH = Path(__file__).resolve().parents[2] / "arguments.md"
HEADER = """# rl_plugin flags

Generated from the parser by `python -m rl_plugin.arguments.docs`; a test fails if it drifts.
Validate a training shell's flags with `python -m rl_plugin.arguments [flags]` (prints the
resolved settings as JSON; exits 2 with the rule and the fix on an invalid combination; checks
the files the flags name too, unless given `--no-file-checks`).

Flags in the **megatron** group are Megatron-LM's own: rl_plugin defines them only when it runs
without Megatron-LM's parser, spelled and defaulted the same way. As Megatron-LM's
`extra_args_provider`, `add_rl_arguments` adds only the RL groups below it.
"""


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off" if action.default is False else "on"
    return "none" if action.default is None else f"`{action.default}`"


def render(parser: argparse.ArgumentParser) -> str:
    out = [HEADER]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        out.append(f"\n## {group.title}\n")
        if group.description:
            out.append(f"{group.description}\n")
        for a in actions:
            names = ", ".join(f"`{s}`" for s in a.option_strings)
            meta = f"default {_default(a)}"
            if a.choices:
                meta += "; choices " + ", ".join(f"`{c}`" for c in a.choices)
            out.append(f"\n### {names}\n\n{meta}.\n\n{a.help or ''}\n")
    return "".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="exit 1 if arguments.md is stale")
    ns = ap.parse_args(argv)
    text = render(build_parser())
    if ns.check:
        if not DOC_PATH.exists() or DOC_PATH.read_text() != text:
            print(f"{DOC_PATH} is stale: run python -m rl_plugin.arguments.docs", file=sys.stderr)
            return 1
        return 0
    DOC_PATH.write_text(text)
    print(f"wrote {DOC_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
