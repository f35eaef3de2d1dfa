"""The primary slices of a plan as columns (``SliceStore``): what the planner writes, and
cover and the digest read, without a Python object per slice."""
from __future__ import annotations

from itertools import repeat

from coordloader.errors import PlanError
from coordloader.planning.model import Form, TensorSlice
from coordloader.planning.runs import RunList


class SliceStore:
    """The primary slices of a plan as columns, indexed by slice id (sid): the planner
    writes a family's slices a column at a time, and cover and the digest read them so,
    without a Python object per slice. ``slice(sid)`` builds the TensorSlice (replica 0)
    on first use and keeps it, so every rank class holding a sid holds one object.

    A slice's byte runs are ``runs[sid]``, or, where that is None, the one run of
    ``lengths[sid]`` bytes at ``starts[sid]`` of ``files[sid]`` into byte 0 (a whole
    tensor stored in one piece: most slices of an expert-parallel plan).

    A store is filled by the planner, then frozen (``freeze``): its columns become tuples
    and its attributes read-only, so that a slice built from it and the columns that
    cover and the digest read agree (the cache of built slices, ``_built``, is private)."""

    __slots__ = ("names", "tensor", "forms", "form", "files", "runs", "starts", "lengths",
                 "blocks", "_built", "_frozen")

    def __init__(self):
        object.__setattr__(self, "_frozen", False)
        self.names: list[str] = []
        self.tensor: list[int] = []      # sid -> its tensor's row in the checkpoint's table
        self.forms: list[Form] = []
        self.form: list[int] = []        # sid -> index into forms
        self.files: list[str] = []       # sid -> TensorSlice.file
        self.runs: list = []             # sid -> its RunList, or None (one run)
        self.starts: list[int] = []      # sid -> the one run's offset (0 where runs is set)
        self.lengths: list[int] = []     # sid -> the one run's length (0 where runs is set)
        self.blocks: list[range] = []    # the sids of each add(): one form, runs alike
        self._built: list = []

    def __len__(self) -> int:
        return len(self.names)

    def __setattr__(self, name: str, value) -> None:
        if self._frozen:
            raise AttributeError(f"a frozen SliceStore's {name} cannot be set")
        object.__setattr__(self, name, value)

    _COLUMNS = ("names", "tensor", "forms", "form", "files", "runs", "starts", "lengths",
                "blocks")

    def freeze(self) -> None:
        """Make every column a tuple and the store read-only (the built-slice cache aside)."""
        if self._frozen:
            return
        for name in self._COLUMNS:
            setattr(self, name, tuple(getattr(self, name)))
        self._frozen = True

    def __delattr__(self, name: str) -> None:
        if self._frozen:
            raise AttributeError(f"a frozen SliceStore's {name} cannot be deleted")
        object.__delattr__(self, name)

    def __getstate__(self) -> dict:
        return {name: getattr(self, name) for name in self._COLUMNS + ("_frozen",)}

    def __setstate__(self, state: dict) -> None:
        # restored past __setattr__, whatever order the state comes in; built slices are
        # not carried (a copy builds its own)
        for name, value in state.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_built", [None] * len(self.names))

    def add(self, names: list[str], tensor: list[int], form: int, files: list[str],
            runs: list | None, starts: list[int] | None = None,
            lengths: list[int] | None = None) -> range:
        """Append the slices of ``names`` (one form; ``tensor``: their rows in the
        checkpoint's ``TensorTable``), their runs given as RunLists (``runs``) or as one
        run each (``starts``, ``lengths``); -> their sids."""
        n = len(names)
        cols = (tensor, files) + ((runs,) if runs is not None else (starts, lengths))
        if any(len(c) != n for c in cols):
            # a short column would shift every later slice's file and offset, unnoticed
            raise PlanError(f"slice columns of {[len(c) for c in cols]} entries for {n} "
                            f"tensors", tensor=names[0] if names else None)
        first = len(self.names)
        self.names += names
        self.tensor += tensor
        self.form += repeat(form, n)
        self.files += files
        if runs is None:
            self.runs += repeat(None, n)
            self.starts += starts
            self.lengths += lengths
        else:
            self.runs += runs
            self.starts += repeat(0, n)
            self.lengths += repeat(0, n)
        self._built += repeat(None, n)
        got = range(first, first + n)
        self.blocks.append(got)
        return got

    def run_list(self, sid: int):
        rl = self.runs[sid]
        if rl is None:
            rl = RunList.single(self.files[sid], self.starts[sid], self.lengths[sid])
        return rl

    def slice(self, sid: int) -> TensorSlice:
        """The slice ``sid`` (replica 0), built on first use and kept."""
        s = self._built[sid]
        if s is None:
            f = self.forms[self.form[sid]]
            s = self._built[sid] = TensorSlice.build(
                self.names[sid], self.files[sid], f.dtype, f.global_shape, f.local_shape,
                f.pieces, 0, self.run_list(sid), f.strategy)
        return s
