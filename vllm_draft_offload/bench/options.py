"""The parsers of the toolkit's commands: one layout (usage line, examples) and the
options that several commands share, spelled and explained the same everywhere."""

from __future__ import annotations

import argparse

PROG = "vllm-draft-offload"


def command_parser(command: str, doc: str | None, examples: str) -> argparse.ArgumentParser:
    """The parser of ``vllm-draft-offload COMMAND``: the module's docstring on top, its
    examples (a text starting ``examples:``) below the options."""
    return argparse.ArgumentParser(
        prog=f"{PROG} {command}",
        description=doc,
        epilog=examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_eager_or_compile(parser: argparse.ArgumentParser) -> None:
    """``--enforce-eager`` (the default of these commands) or ``--compile``, as
    ``args.compile``: long load runs start engines eagerly unless told otherwise."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--enforce-eager",
        dest="compile",
        action="store_false",
        help="engines without CUDA graphs (the default here: faster starts)",
    )
    group.add_argument("--compile", action="store_true", help="compiled engines (slower start)")
    # Both flags share ``dest``; argparse would take the first one's default (True, of
    # ``store_false``), i.e. compile unless told otherwise.
    parser.set_defaults(compile=False)


def add_child_args(parser: argparse.ArgumentParser) -> None:
    """The hidden options a benchmark passes to its own child process (one engine per
    process: `--child OUT.json` with the model paths and the configuration to run)."""
    parser.add_argument(
        "--engine-timeout",
        type=float,
        default=900.0,
        help="seconds one engine's child process may run; past it the engine is killed, "
        "its entry records the timeout, and the run goes on (default 900)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--draft", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
