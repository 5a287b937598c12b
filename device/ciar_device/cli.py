"""What the command lines share (`python -m ciar_device` and the project's `python -m ciar.generate`): one-line
usage errors (exit status 2), output-path checks before any work (missing folders created), and the prompt / seed checks."""

from __future__ import annotations

import argparse
import os


class UsageError(Exception):
    """A bad command line, input or server answer: reported as one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise UsageError (one readable line) instead of printing usage and exiting."""

    def error(self, message):
        raise UsageError(message)


def check_writable(path: str, flag: str) -> None:
    """Refuse an output path that cannot be written, before any work is done; a missing folder is created (as
    `mkdir -p` would: `--out out/img.png` works in a fresh checkout)."""
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path!r} is a directory, expected a file path")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{flag}: cannot create folder {folder!r}: {e.strerror or e}") from None
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{flag}: folder {folder!r} is not writable")


def write_file(path: str, data: bytes, flag: str) -> None:
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as e:
        raise UsageError(f"{flag}: cannot write {path!r}: {e.strerror or e}") from None


def check_prompt_and_seed(prompt: str, seed: int) -> None:
    if not prompt.strip():
        raise UsageError("--prompt is empty")
    if not 0 <= seed < 2 ** 63:
        raise UsageError(f"--seed must be in [0, 2**63), got {seed}")


def run_command(prog: str, parser: argparse.ArgumentParser, run, argv: list[str] | None):
    """Parse `argv` and call `run(args)`. -> (args, result), or (None, exit status) after a UsageError (printed as
    one `prog: error:` line, status 2) or --help (status 0)."""
    import sys

    try:
        args = parser.parse_args(argv)
        return args, run(args)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return None, 2
    except SystemExit as e:  # --help
        return None, e.code if isinstance(e.code, int) else 0
