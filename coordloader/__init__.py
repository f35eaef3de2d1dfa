"""coordloader: rank-aware distributed loading of safetensors checkpoints.

checkpoint/ (metadata) -> planning/ (plan, cover) -> engines/ -> verify/ (checks, digest);
dist/ (phase agreement) beside them; handoff/ (save, consolidate, dump) and loader (load)
use them all; cli/ holds the commands, reached through the `python -m` shims.
"""
import os as _os
import sys as _sys

# Under `python -m coordloader.<tool>` (torchrun included) errors are one line on stderr;
# torch's C++ logger would print c10d socket warnings before it. This must run before torch
# is imported, and argv[0] is "-m" only while runpy imports the package, so library users'
# log settings are left alone (the `coordloader` console script counts as an entry point).
if _sys.argv[:1] == ["-m"] or _os.path.basename((_sys.argv or [""])[0]) == "coordloader":
    _os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from coordloader.api import make_plan

# Two public functions share their name with a `python -m` shim module (`load`,
# `consolidate`): this package never imports those shims, and each shim is callable as its
# function (coordloader.cli.shim), so `coordloader.load(...)` works however it is reached.
from coordloader.checkpoint.reader import read_checkpoint
from coordloader.errors import (
    CheckpointError,
    CollectiveError,
    CoordloaderError,
    LoadError,
    PlanError,
    SaveError,
    VerifyError,
)
from coordloader.handoff.consolidate import consolidate
from coordloader.handoff.pieces import Boxed
from coordloader.handoff.publish import recover_save
from coordloader.handoff.save import save
from coordloader.layout import Layout
from coordloader.loader import load, load_detailed, load_into
from coordloader.planning.cover import validate_cover
from coordloader.synth import synthesize
from coordloader.verify.checks import verify_rank
from coordloader.verify.digest import digest
from coordloader.verify.manifest import write_manifest

__version__ = "0.1.0"

__all__ = ["Layout", "CoordloaderError", "CheckpointError", "PlanError", "LoadError",
           "VerifyError", "SaveError", "CollectiveError", "read_checkpoint", "make_plan",
           "validate_cover", "load", "load_detailed", "load_into", "verify_rank", "digest",
           "write_manifest", "save", "Boxed", "recover_save", "consolidate", "synthesize", "__version__"]
