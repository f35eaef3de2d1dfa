"""How ids are written in messages and tables, and how long a message may be (one way,
used by every stage)."""
from __future__ import annotations

import argparse
import numbers
import sys
from typing import Callable, Iterable, Sequence


def format_ranges(ids: Iterable[int], *, empty: str = "", max_chars: int | None = None) -> str:
    """Sorted distinct ids as runs: ``[5, 0, 1, 2, 7, 8]`` -> ``0-2,5,7,8`` (a run of two is
    written as both ids). ``empty`` stands for no ids; ``max_chars`` cuts a long result
    with ``...``."""
    ids = sorted(set(ids))
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if j == i else
                   f"{ids[i]},{ids[j]}" if j == i + 1 else f"{ids[i]}-{ids[j]}")
        i = j + 1
    s = ",".join(out) or empty
    if max_chars is not None and len(s) > max_chars:
        s = s[:max_chars - 3] + "..."
    return s


def first_items(items: Sequence[str], n: int, more: str = " ...") -> str:
    """The first ``n`` of ``items`` joined by ", ", then ``more`` where some are left out:
    a message names a few of a long list."""
    return ", ".join(items[:n]) + (more if len(items) > n else "")


def nul_problem(what: str, path: str) -> str | None:
    """The message for a ``path`` holding a NUL character, which no file path can (every
    system call refuses it with a ValueError naming no path), ``what`` naming it; None
    for a path without one."""
    return f"{what} {path[:200]!r} holds a NUL character, which no file path can" \
        if "\0" in path else None


def format_ranks(ranks: Iterable[int]) -> str:
    """``format_ranges`` after the word the ids take: ``rank 3``, ``ranks 0-2,5``."""
    ranks = set(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + format_ranges(ranks)


# Every message a user sees is bounded, whatever the input: a crafted checkpoint can name a
# tensor with 10 MB of characters and a rank's message travels through the status board.
MAX_MESSAGE_CHARS = 2000    # one error line, one warning, one usage error
MAX_NAME_CHARS = 200        # a file, tensor or pattern quoted inside a message


def clip(text: str, max_chars: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` when it fits in ``max_chars``; else its head and tail around a note of how
    much was cut. The tail stays because that is where a message says what was expected."""
    if len(text) <= max_chars:
        return text
    keep = max_chars
    for _ in range(3):   # the note's own length changes how much is cut; settles at once
        note = f"...[{len(text) - keep} chars cut]..."
        keep = max(max_chars - len(note), 2)
    note = f"...[{len(text) - keep} chars cut]..."
    head = keep - keep // 3
    return text[:head] + note + text[len(text) - (keep - head):]


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the message cap: a usage error quotes the offending value, which may
    be megabytes long. Every command's parser (cli/, the bench) is one of these."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {clip(message)}\n")


def positive_number(unit: str, maximum: float | None = None,
                    minimum: float | None = None) -> Callable[[str], float]:
    """An argparse type: a finite number of ``unit`` above 0 (and at most ``maximum``, at
    least ``minimum``). Zero, negative, nan, inf and huge values would otherwise reach the
    code as a bare error or be clamped into something else."""
    def parse(text: str) -> float:
        shown = clip(repr(text), MAX_NAME_CHARS)
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{shown} is not a number of {unit}") from None
        if not 0 < v < float("inf"):
            raise argparse.ArgumentTypeError(f"{shown}: expected a finite number of {unit} "
                                             f"greater than 0")
        if maximum is not None and v > maximum:
            raise argparse.ArgumentTypeError(f"{shown}: expected at most {maximum:g} {unit}")
        if minimum is not None and v < minimum:
            raise argparse.ArgumentTypeError(f"{shown}: expected at least {minimum:g} {unit}")
        return v
    return parse


def positive_count(unit: str) -> Callable[[str], int]:
    """An argparse type: a whole number of ``unit`` >= 1 (0 or a negative count was taken
    as some default, or as none)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < 1:
            raise argparse.ArgumentTypeError(f"{clip(repr(text), MAX_NAME_CHARS)}: expected a "
                                             f"whole number of {unit} >= 1")
        return n
    return parse


def positive_int_problem(name: str, value) -> str | None:
    """Why ``value``, given for the argument ``name`` (a size in bytes), is not a positive
    integer, or None. Compared with 0 unchecked, None or a string ("1GB") raised a bare
    TypeError, and 0 or a negative size was taken as one byte per file or block. A float
    of an integer value (``5e9``, as sizes are often written) is one."""
    if isinstance(value, bool):
        pass
    elif isinstance(value, numbers.Integral) and value > 0:
        return None
    elif isinstance(value, float) and value.is_integer() and value > 0:
        return None
    return f"{name} must be a positive integer, got {clip(repr(value), MAX_NAME_CHARS)}"
