"""The `monitord` command line: parses arguments and hands each verb to its module.

Each verb lives in a module that declares `VERBS = {verb: (add_arguments, main)}`; only the
invoked verb's module is imported (a verb run over SSH on the VPS must not pay for, or even
have, the PBX side), and modules keep heavy imports inside `main` so that `--help`,
`--version` and bad usage stay fast.
Exit codes: 0 ok, 2 bad usage or config, 3 duplicate instance, 130 interrupted (Ctrl-C);
`status --check` has its own (monitord.surface.client_commands).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_DUPLICATE = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C

# verb -> (module, one-line help). Internal verbs (run on the VPS by the local owner)
# are listed too; they are not for operators and say so in their help.
VERBS: dict[str, tuple[str, str]] = {
    "run": ("monitord.surface.daemon", "run the daemon in the foreground (systemd runs this)"),
    "launch": ("monitord.surface.launcher", "start the daemon detached unless it already runs"),
    "status": ("monitord.surface.client_commands", "show tunnel, services, areas and transactions"),
    "areas": ("monitord.surface.client_commands",
              "list the areas: title, side, health, pid, uptime, restarts, last downtime"),
    "logs": ("monitord.surface.client_commands",
             "show an area's log, local or remote (-f: follow it)"),
    "place": ("monitord.surface.client_commands", "move a service to local or remote"),
    "retry": ("monitord.surface.client_commands", "let a parked service try again"),
    "rollback": ("monitord.surface.client_commands",
                 "override a rollback that waits for data: --discard-remote-data SERVICE"),
    "give-up": ("monitord.surface.client_commands",
                "give the VPS up for SERVICE: its areas start on the PBX's own copy"),
    "fetch-abandoned": ("monitord.surface.client_commands",
                        "fetch a given-up VPS copy of AREA to the PBX (forensics)"),
    "bundle": ("monitord.surface.client_commands", "write a diagnostic bundle (.tar.gz)"),
    "demo": ("monitord.surface.demo", "run the self-contained demonstration (no root, no VPS)"),
    "check": ("monitord.surface.check_command", "check the configuration (--remote: the VPS too)"),
    "agent": ("monitord.vps.cli", "run the remote agent on the VPS"),
    "agent-launch": ("monitord.vps.cli", "start the agent detached unless it already runs"),
    "tunnel-lease": ("monitord.vps.tunnel_lease", "internal: tunnel lease ops on the VPS"),
    "log-sink": ("monitord.base.log_sink", "internal: copy stdin to a size-capped log"),
    "log-hub": ("monitord.base.log_hub", "internal: copy every area's output to its capped log"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `only`, just that verb's module is imported (the others keep their
    name and help): a verb run over SSH on the VPS should not pay for every other verb."""
    from monitord import __version__

    parser = argparse.ArgumentParser(prog="monitord", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"monitord {__version__}")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for verb, (module_name, help_text) in VERBS.items():
        verb_parser = sub.add_parser(verb, help=help_text, description=help_text)
        if only is not None and verb != only:
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if not (e.name and module_name.startswith(e.name)):
                raise
            verb_parser.set_defaults(_missing=module_name)
            continue
        add, run = module.VERBS[verb]
        add(verb_parser)
        verb_parser.set_defaults(_entry=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    verb = next((w for w in words if not w.startswith("-")), None)
    # No verb (`--version`, `--help`): the verb list needs no verb module at all.
    parser = build_parser(only=verb if verb in VERBS else "" if verb is None else None)
    parser.set_defaults(_missing=None)
    args = parser.parse_args(words)
    if args._missing:
        print(f"monitord: '{args.verb}' is not available in this build", file=sys.stderr)
        return EXIT_USAGE
    try:
        result: int = args._entry(args)
    except KeyboardInterrupt:  # Ctrl-C in a verb that does not handle signals itself
        print("monitord: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return result
