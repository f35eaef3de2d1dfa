"""What every command shares: the error/exit policy, and where outputs may go."""
from __future__ import annotations

import os
from typing import Callable

from coordloader.checkpoint.reader import (
    checkpoint_dir,
    checkpoint_file_at,
    is_checkpoint_file,
    read_with_checkpoint,
)
from coordloader.dist.collective import exit_on_error
from coordloader.errors import ConfigError


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


def refuse_checkpoint_file(out: str | None, checkpoint: str, flag: str) -> None:
    """ConfigError when the output file ``out`` of ``flag`` would replace a file in the
    checkpoint's own directory (a shard, its config, its index), or add one there that the
    reader would read as part of the checkpoint (``is_checkpoint_file``: a report named
    ``model.safetensors.index.json`` made the checkpoint unloadable): checked before any
    work."""
    if not out or out == "-":
        return
    name = checkpoint_file_at(out, checkpoint)
    if name is None:
        return
    root = checkpoint_dir(checkpoint)
    if os.path.lexists(out):
        raise ConfigError(f"{flag} {out} would replace {name} in the checkpoint directory "
                          f"{root}; write it elsewhere", file=out)
    if is_checkpoint_file(name):
        raise ConfigError(f"{flag} {out} would add {name} to the checkpoint directory {root}, "
                          f"where it would be read as part of the checkpoint; write it "
                          f"elsewhere", file=out)


def refuse_checkpoint_dir(out_dir: str | None, checkpoint: str, flag: str) -> None:
    """ConfigError when the output directory of ``flag`` is the checkpoint's own: files
    written there would be read as part of the checkpoint."""
    if not out_dir:
        return
    root = checkpoint_dir(checkpoint)
    if os.path.realpath(out_dir) == os.path.realpath(root):
        raise ConfigError(f"{flag} {out_dir} is the checkpoint directory: its files would be "
                          f"read as part of the checkpoint; write it elsewhere", file=out_dir)
    name = read_with_checkpoint(out_dir, checkpoint)
    if name is not None:
        # a directory under a checkpoint file's name makes the source two checkpoints
        raise ConfigError(f"{flag} {out_dir} would add {name} to the checkpoint directory "
                          f"{root}, where it would be read as part of the checkpoint; write "
                          f"it elsewhere", file=out_dir)


def refuse_over_inputs(out: str | None, flag: str, args) -> None:
    """ConfigError when the output file of ``flag`` is a file the command reads (its
    ``--config``, ``--rules`` or ``--placement`` file): it was replaced by the output, and
    the next run read a report as its config."""
    if not out or out == "-":
        return
    target = os.path.realpath(out)
    for in_flag in ("--config", "--rules", "--placement"):
        path = getattr(args, in_flag[2:], None)
        if not isinstance(path, str):
            continue
        if in_flag == "--config" and os.path.isdir(path):   # read as DIR/config.json
            path = os.path.join(path, "config.json")
        if os.path.isfile(path) and os.path.realpath(path) == target:
            raise ConfigError(f"{flag} {out} is the {in_flag} file this command reads; write "
                              f"it elsewhere", file=out)
