"""The `python -m coordloader.<tool>` modules are thin shims over `coordloader.cli`.

Two of them share their name with a public function (`coordloader.load`,
`coordloader.consolidate`). The package binds the functions; it never imports the shims,
so `cl.load(...)` is the function. Should anyone import a shim as a module anyway (Python
then rebinds the package attribute to it), the shim stays callable as that function, so
`cl.load(...)` keeps working either way.
"""
from __future__ import annotations

import sys
import types
from typing import Callable


def make_callable(module_name: str, fn: Callable) -> None:
    """Let module `module_name` be called as `fn` (for the shims named like a function)."""
    mod = sys.modules[module_name]

    class _CallableModule(types.ModuleType):
        __doc__ = fn.__doc__

        def __call__(self, *args, **kwargs):
            return fn(*args, **kwargs)

    mod.__class__ = _CallableModule
