"""What every command shares: the error/exit policy."""
from __future__ import annotations

from typing import Callable

from coordloader.dist.collective import exit_on_error


def run_command(tool: str, body: Callable[[], int | None]) -> int:
    """Run a single-process command's ``body`` under the one error policy
    (``dist.collective.exit_on_error``): an error is one line on stderr,
    ``coordloader <tool>: <ErrorType>: <message>``, and exit code 1; Ctrl-C is 130; argparse's
    usage errors stay 2. Returns the exit code instead of exiting, so ``main(argv)`` can be
    called from Python."""
    try:
        with exit_on_error(tool=tool):
            return int(body() or 0)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
