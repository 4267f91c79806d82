"""``python -m rl_plugin.arguments [flags]``: parse and validate a training shell's flags.

Prints the resolved settings as JSON and exits 0; an invalid combination exits 2 with the
message on stderr. Run it on a job's flags before queueing it on a cluster.
"""

from __future__ import annotations

import json
import sys

from rl_plugin.arguments import RLArgumentError, build_parser, validate_rl_args


def main(argv=None) -> int:
    parser = build_parser(prog="python -m rl_plugin.arguments")
    args = parser.parse_args(argv)  # argparse itself exits 2 on unknown flags / bad choices
    try:
        validate_rl_args(args)
    except RLArgumentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(vars(args), indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
