"""The command line of monitord.pyz: the verbs that run on the VPS, and nothing else.

`python3 monitord.pyz VERB ...` (or `python -m monitord.vps VERB ...` from an installed tree)
runs one of: agent, agent-launch, tunnel-lease, self-check, lease-guard, log-sink,
log-hub, tree-digest, guard-forkserver. Standard
library only, so it runs under a bare system Python in isolated mode (`python3 -I`). The PBX's
`monitord` command serves the operator verbs and, for tests and one-machine set-ups, the
same VPS verbs through the same modules.
Exit codes: 0 ok, 1 failure, 2 bad usage, 3 duplicate instance.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# verb -> (module, one-line help); each module declares VERBS = {verb: (add_arguments, run)}.
VERBS = {
    "agent": ("monitord.vps.cli", "run the remote agent in the foreground"),
    "agent-launch": ("monitord.vps.cli", "start the agent detached unless it already runs"),
    "tunnel-lease": ("monitord.vps.tunnel_lease", "tunnel lease operations (run over SSH)"),
    "self-check": ("monitord.vps.self_check", "check that this VPS can run the agent"),
    "log-sink": ("monitord.base.log_sink", "copy stdin to a size-capped, rotated log file"),
    "log-hub": ("monitord.base.log_hub", "copy every area's output to its size-capped log"),
    "tree-digest": ("monitord.base.tree_digest", "SHA-256 of a tree, re-hashing what changed"),
    "guard-forkserver": ("monitord.vps.guard_forkserver",
                         "internal: fork the lease guards from one warm process"),
}
# Verbs that parse their own arguments (argv after the verb is passed through untouched).
RAW_VERBS = {"lease-guard": "monitord.vps.lease_guard"}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="monitord.pyz", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for verb, (module_name, help_text) in VERBS.items():
        verb_parser = sub.add_parser(verb, help=help_text, description=help_text)
        if verb != only:
            continue  # `--help` and bad usage import nothing but this module
        add, run = importlib.import_module(module_name).VERBS[verb]
        add(verb_parser)
        verb_parser.set_defaults(_entry=run)
    for verb in RAW_VERBS:
        sub.add_parser(verb, help="internal: the lease guard of one remote daemon")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    verb = args[0] if args else None
    if verb in RAW_VERBS:
        module = importlib.import_module(RAW_VERBS[verb])
        return int(module.main(args[1:]))
    parsed = build_parser(only=verb if verb in VERBS else None).parse_args(args)
    return int(parsed._entry(parsed))
