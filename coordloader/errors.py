"""Typed errors. Every failure a user can cause carries the context needed to fix it
(file, tensor, rank, what was expected), so callers never see a bare traceback."""
from __future__ import annotations

from coordloader.text import MAX_NAME_CHARS, clip


class CoordloaderError(Exception):
    """Base class of every error coordloader raises on purpose."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None,
                 rank: int | None = None):
        self.message = clip(message)
        self.file = file
        self.tensor = tensor
        self.rank = rank
        super().__init__(self._render())

    def _render(self) -> str:
        where = []
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        if self.file is not None:
            where.append(f"file {clip(str(self.file), MAX_NAME_CHARS)}")
        if self.tensor is not None:
            where.append(f"tensor {clip(repr(self.tensor), MAX_NAME_CHARS)}")
        return (", ".join(where) + ": " + self.message) if where else self.message

    def __reduce__(self):
        # Errors travel between ranks through all_gather_object: keep the context.
        return (_rebuild, (type(self), self.message, self.file, self.tensor, self.rank))


def _rebuild(cls, message, file, tensor, rank):
    return cls(message, file=file, tensor=tensor, rank=rank)


class CheckpointError(CoordloaderError):
    """The checkpoint on disk is malformed, unsafe, or not what the index says."""


class PlanError(CoordloaderError):
    """The layout or the rules cannot be applied to this checkpoint."""


class LoadError(CoordloaderError):
    """Moving bytes failed: I/O, engine, device, or a collective."""


class VerifyError(CoordloaderError):
    """A rank's tensors do not match its plan or the checkpoint's content."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None,
                 rank: int | None = None, report: dict | None = None):
        self.report = report or {}
        super().__init__(message, file=file, tensor=tensor, rank=rank)

    def __reduce__(self):
        return (_rebuild_verify, (self.message, self.file, self.tensor, self.rank, self.report))


def _rebuild_verify(message, file, tensor, rank, report):
    return VerifyError(message, file=file, tensor=tensor, rank=rank, report=report)


class ConfigError(CoordloaderError):
    """A setting handed to coordloader (an option, a serving engine's loader config or
    parallel layout) is invalid or not supported."""


class SaveError(CoordloaderError):
    """Writing a checkpoint or manifest failed; the previous state on disk is intact."""


class CollectiveError(CoordloaderError):
    """Another rank failed, or did not arrive in time; names the rank and its cause.

    ``phase``: the phase the group was in; ``failures``: rank -> (error type, message) of
    every rank that failed it; ``missing``: ranks that never arrived; ``local_error``: this
    rank's own exception in the phase, if it had one (not carried between processes)."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None,
                 rank: int | None = None, phase: str | None = None,
                 failures: dict[int, tuple[str, str]] | None = None, missing=(),
                 local_error: BaseException | None = None):
        self.phase = phase
        self.failures = dict(failures or {})
        self.missing = list(missing)
        self.local_error = local_error
        super().__init__(message, file=file, tensor=tensor, rank=rank)

    def __reduce__(self):
        return (_rebuild_collective, (self.message, self.file, self.tensor, self.rank, self.phase,
                                      self.failures, self.missing))


def _rebuild_collective(message, file, tensor, rank, phase, failures, missing):
    return CollectiveError(message, file=file, tensor=tensor, rank=rank, phase=phase,
                           failures=failures, missing=missing)


class FitError(LoadError):
    """A serving engine's weight loaders and a rank's planned slices disagree: they asked
    for elements the rank does not hold, touched a held tensor's data in a way that cannot
    be answered from the rank's slices, or left held elements unused."""
