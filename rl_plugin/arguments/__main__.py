"""``python -m rl_plugin.arguments [flags]``: parse and validate a training shell's flags.

Checks what needs no world, exactly as ``rl-plugin-train`` does in its first second: the flag
rules (with the embedded defaults when there is no ``--prompt-data``), the data-parallel rules
for the DP size the cluster flags imply, the files the flags name (``arguments.paths``) and
what they hold (``arguments.file_contents``: the checkpoint to resume, its LoRA adapters, the
SFT conversations or RL prompts, the OPD teacher; the same function as the trainer's preflight,
so the same one-line message).
Flags that nothing reads in the chosen configuration are refused or warned
(``arguments.unread_flags``; a warning is a ``warning:`` line on stderr). Prints the resolved
settings as JSON and exits 0; an invalid combination exits 2 with the
message on stderr. Run it on a job's flags before queueing it on a cluster; on a machine that
does not hold the job's files, add ``--no-file-checks`` (a checker option, not a trainer flag)
to check the flags alone.
"""

from __future__ import annotations

import json
import sys

from rl_plugin.arguments import RLArgumentError, run_config_of
from rl_plugin.arguments.embedded import parse_train_flags
from rl_plugin.arguments.file_contents import check_file_contents
from rl_plugin.arguments.setup import check_command_line

NO_FILE_CHECKS = "--no-file-checks"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    check_files = NO_FILE_CHECKS not in argv
    argv = [a for a in argv if a != NO_FILE_CHECKS]
    try:
        args = parse_train_flags(argv, prog="python -m rl_plugin.arguments")  # argparse itself exits 2 on unknown flags
        check_command_line(args, files=check_files)  # layout warnings on stderr
        if check_files:
            check_file_contents(run_config_of(args))  # the trainer's preflight runs the same function
    except RLArgumentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(vars(args), indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
