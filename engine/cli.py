"""``mtpserve COMMAND [ARGS...]``: one entry point, each command imported only when used."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("app.server", "run the OpenAI-compatible server"),
    "train": ("train.cli", "train MTP modules / the demo model"),
    "eval": ("train.eval_cli", "evaluate acceptance and quality"),
    "bench": ("bench.cli", "benchmark throughput and latency"),
    "simulate": ("engine.simulator.cli", "simulate speculative decoding speedups"),
}


def _parser() -> argparse.ArgumentParser:
    lines = [f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items()]
    parser = argparse.ArgumentParser(
        prog="mtpserve",
        description="mtpserve commands:\n" + "\n".join(lines),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=sorted(COMMANDS), metavar="COMMAND")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the command")
    return parser


def _load(command: str) -> Callable[[list[str]], Any] | None:
    module_name = COMMANDS[command][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if not module_name.startswith(missing) or not missing:
            raise  # a dependency inside the command is missing: show the real error
        print(
            f"mtpserve: the '{command}' command is not available "
            f"(module {module_name} is not installed in this build)",
            file=sys.stderr,
        )
        return None
    fn: Callable[[list[str]], Any] = module.main
    return fn


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    fn = _load(args.command)
    if fn is None:
        return 2
    result = fn(list(args.args))
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
