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

megatron-core also decorates about 40 functions with `torch.compile` as it imports (`megatron.core.jit.
jit_fuser`), and the first such call imports torch._dynamo and torch._inductor: about 2.5 s of CPU per
process, for functions a CPU run never calls. Without CUDA, `defer_compile_at_megatron_import()` (run by
`import hybridrl`) has `megatron.core` import under a torch.compile that wraps each function to compile at
its first call - what torch.compile does anyway - so the compiler is imported only if one is called;
torch.compile is itself again once megatron.core is in. With CUDA nothing changes.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
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


def compile_on_first_call(real):
    """A torch.compile that leaves plain functions uncompiled until their first call (then `real` compiles
    them, with the same options); anything else goes to `real` at once."""

    def compile_later(model=None, **options):
        if model is None:  # @torch.compile(...) with options
            return lambda fn: compile_later(fn, **options)
        if not inspect.isfunction(model):
            return real(model, **options)
        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **options)
            return compiled(*args, **kwargs)

        return first_call_compiles

    return compile_later


class _DeferCompileLoader:
    """Runs megatron.core's own loader with torch.compile deferring (see the module docstring)."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        import torch

        if torch.cuda.is_available():
            self.inner.exec_module(module)
            return
        real = torch.compile
        torch.compile = compile_on_first_call(real)
        try:
            self.inner.exec_module(module)
        finally:
            torch.compile = real

    def __getattr__(self, attr: str):
        return getattr(self.inner, attr)


class _MegatronCoreFinder:
    """A sys.meta_path entry for the first import of megatron.core: its spec, with the loader wrapped."""

    def find_spec(self, name, path=None, target=None):
        if name != "megatron.core":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _DeferCompileLoader(spec.loader)
        return spec


def defer_compile_at_megatron_import() -> bool:
    """Install the finder unless megatron.core is imported already (or the finder is in place)."""
    if "megatron.core" in sys.modules or any(isinstance(f, _MegatronCoreFinder) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, _MegatronCoreFinder())
    return True
