"""``vllm-draft-offload``: one command for the toolkit's fixtures, checks and benchmarks.

    vllm-draft-offload COMMAND [OPTIONS]      (or: python -m vllm_draft_offload.bench ...)

Each command is one module's ``main(argv)``, so its options are that module's own
parser (``vllm-draft-offload COMMAND --help``), and the module can be imported from
other code as well. A command's module is imported only when that command runs, so
the listing loads none of them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_draft_offload.bench.options import PROG


@dataclass(frozen=True)
class Command:
    name: str
    module: str  # under vllm_draft_offload.bench; its main(argv) runs the command
    summary: str


COMMANDS: tuple[Command, ...] = (
    Command("fixtures", "fixtures.build", "build the fixture models (targets, drafters, MTP)"),
    Command("accept", "accept.check", "acceptance restored vs fresh, or the KV-sensitivity run"),
    Command("table", "accept.table", "the docs' acceptance tables from a directory of results"),
    Command("bench", "workloads.run", "workload benchmark: ours vs vLLM native vs LMCache"),
    Command("restore-speed", "speed.restore", "TTFT and copy GB/s of a restore at 8B/1B shapes"),
    Command("copy-speed", "speed.copy", "copy GB/s by page size: DMA vs Triton kernel vs auto"),
    Command(
        "decode-overhead",
        "speed.decode_overhead",
        "decode tok/s storing every chunk vs no connector; multi-turn decode-KV reuse",
    ),
    Command(
        "hook-cost",
        "speed.hook_cost",
        "CPU microseconds of the connector's hooks per decode step (CPU, real Scheduler)",
    ),
    Command("l3-speed", "speed.l3_fetch", "storage-tier fetch GB/s by threads, next to raw disk"),
    Command(
        "l3-stages",
        "speed.l3_stages",
        "warm fs:// fetch vs plain read of the same files: read/checksum split, GIL and writes",
    ),
    Command("shared-storage", "accept.shared_storage", "two engines, one fs:// dir: B hits A"),
    Command("pressure", "stress.pressure", "working set > GPU cache: outputs, hits, acceptance"),
    Command("soak", "stress.soak", "long mixed load while storage fails: crashes, memory, TTFT"),
    Command("serve-bench", "serve.run", "vllm bench serve on vllm serve, with/without connector"),
    Command("dashboard-render", "serve.dashboard", "the Grafana dashboard as a PNG from scrapes"),
    Command(
        "spy-report",
        "stress.spy_report",
        "where engine threads' time goes, from a py-spy raw profile",
    ),
)
BY_NAME: dict[str, Command] = {c.name: c for c in COMMANDS}

EXAMPLES = f"""shared options, spelled the same in every command that has them:
  --fixtures DIR    the fixture directory `{PROG} fixtures --out DIR` wrote
  --out PATH        where results go: a directory (fixtures, bench, shared-storage,
                    pressure, soak, serve-bench) or a file (accept, table,
                    restore-speed, copy-speed, decode-overhead, hook-cost,
                    l3-speed, l3-stages, dashboard-render, spy-report)
  --enforce-eager   engines without CUDA graphs: faster starts (the default of
                    pressure and soak, whose --compile turns it off)

examples:
  {PROG} fixtures --out /tmp/fx --preset tiny
  {PROG} bench --fixtures /tmp/fx --dry-run-cpu --out /tmp/bench
  {PROG} accept --fixtures /tmp/fx --spec-method draft_model --draft self-draft \\
      --out /tmp/accept.json
  {PROG} bench --help
"""


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: lists the commands (dispatch itself is by name, in main)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Fixtures, acceptance checks and benchmarks of the draft-offload connector.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", dest="command")
    for command in COMMANDS:
        commands.add_parser(command.name, help=command.summary, add_help=False)
    return parser


def _version() -> str:
    from vllm_draft_offload import __version__

    return __version__


def run(name: str, argv: Sequence[str]) -> int:
    """Run command ``name`` with its own arguments; its exit status."""
    command = BY_NAME[name]
    module = importlib.import_module(f"vllm_draft_offload.bench.{command.module}")
    rc = module.main(list(argv))
    # Some tools return their report (or None) rather than a status: they succeeded.
    return rc if isinstance(rc, int) else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not args or args[0] not in BY_NAME:
        # No command, --help, --version, or an unknown command: argparse prints the
        # listing or the error (and exits).
        parser.parse_args(args)
        parser.print_help()
        return 2
    return run(args[0], args[1:])


if __name__ == "__main__":
    sys.exit(main())
