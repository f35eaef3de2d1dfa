"""coordloader: rank-aware distributed loading of safetensors checkpoints."""
from .errors import (CheckpointError, CollectiveError, CoordloaderError, LoadError, PlanError,
                     SaveError, VerifyError)
from .layout import Layout

__version__ = "0.1.0"

__all__ = ["Layout", "CoordloaderError", "CheckpointError", "PlanError", "LoadError",
           "VerifyError", "SaveError", "CollectiveError", "__version__"]
