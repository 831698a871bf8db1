"""What every hybridrl process pays before its first step, kept small.

megatron-core 0.16 imports wandb at module level (its inference contexts and timers) only to log to it
when handed a wandb writer, which hybridrl never does. Importing wandb costs about 2 s of CPU, paid by
every rank of every run wherever wandb is installed. `defer_optional_imports()` (run by `import
hybridrl`) puts a stand-in module under such a name when the package is installed and not yet imported:
`import wandb` succeeds at once, and the first attribute read through the stand-in (`wandb.init` in
hybridrl's W&B logger) or the first import of a submodule imports the real package, which then replaces
the stand-in in sys.modules. A package that is not installed stays absent (`import wandb` raises).
(importlib.util.LazyLoader does not help here: the `import` statement itself reads the module's
`__spec__`, which makes a lazy module load.)
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types

DEFERRED = ("wandb",)


class Deferred(types.ModuleType):
    """Stands for an installed, not yet imported package; any attribute it lacks imports the package."""

    def __getattr__(self, attr: str):
        name = self.__name__
        if sys.modules.get(name) is self:
            del sys.modules[name]
        try:
            real = importlib.import_module(name)
        except BaseException:
            sys.modules.setdefault(name, self)
            raise
        return getattr(real, attr)


def defer(name: str) -> bool:
    """Put a stand-in for the installed top-level package `name`; False when it is absent or imported."""
    if name in sys.modules:
        return False
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    stand_in = Deferred(name)
    stand_in.__spec__ = spec  # import statements read it (and its _initializing flag) and go no further
    stand_in.__file__ = spec.origin  # inspect.getmodule reads every module's __file__ (torch does, at import)
    sys.modules[name] = stand_in
    return True


def defer_optional_imports() -> None:
    for name in DEFERRED:
        defer(name)
