"""coordloader: rank-aware distributed loading of safetensors checkpoints.

metadata (checkpoint) -> plan (plan, cover) -> engine (engines) -> verify (verify, digest)
"""
import os as _os
import sys as _sys
import warnings

# Under `python -m coordloader.<tool>` (torchrun included) errors are one line on stderr;
# torch's C++ logger would print c10d socket warnings before it. This must run before torch
# is imported, and argv[0] is "-m" only while runpy imports the package, so library users'
# log settings are left alone (the `coordloader` console script counts as an entry point).
if _sys.argv[:1] == ["-m"] or _os.path.basename((_sys.argv or [""])[0]) == "coordloader":
    _os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

# `python -m coordloader.load` imports this package first, which (below) imports the
# submodule; runpy then warns that it is already in sys.modules. Running it again as
# __main__ is harmless here (no import-time side effects), so the warning is noise.
warnings.filterwarnings("ignore", category=RuntimeWarning,
                        message=r".*found in sys\.modules after import of package 'coordloader'")

from .errors import (CheckpointError, CollectiveError, CoordloaderError, LoadError, PlanError,
                     SaveError, VerifyError)
from .layout import Layout

# Imported eagerly, on purpose: several public functions share their module's name
# (load, digest, save, consolidate). Binding the function after the submodule import keeps
# `coordloader.load` the function even when `coordloader.load` the module is imported later.
from .checkpoint import read_checkpoint
from .plan import make_plan
from .cover import validate_cover
from .load import load, load_detailed, load_into
from .verify import verify_rank
from .digest import digest
from .manifest import write_manifest
from .save import save
from .consolidate import consolidate
from .synth import synthesize

__version__ = "0.1.0"

__all__ = ["Layout", "CoordloaderError", "CheckpointError", "PlanError", "LoadError",
           "VerifyError", "SaveError", "CollectiveError", "read_checkpoint", "make_plan",
           "validate_cover", "load", "load_detailed", "load_into", "verify_rank", "digest",
           "write_manifest", "save", "consolidate", "synthesize", "__version__"]
