"""How ids are written in messages and tables (one way, used by every stage)."""
from __future__ import annotations

from typing import Iterable


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
