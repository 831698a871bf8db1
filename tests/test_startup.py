"""Start-up cost: megatron-core's module-level `import wandb` no longer runs wandb (about 2 s per rank);
a deferred package loads on first use, whole, once; one that is not installed stays absent."""
import subprocess
import sys
import textwrap

import pytest


def _run(code: str, tmp_path, extra_path=None):
    env_path = [str(extra_path)] if extra_path else []
    script = f"import sys; sys.path[:0] = {env_path!r}\n" + textwrap.dedent(code)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()


def test_megatron_imports_without_running_wandb(tmp_path):
    pytest.importorskip("wandb")
    out = _run("""
        import hybridrl, megatron.core, megatron.core.models.gpt
        from megatron.core.inference.contexts import dynamic_context
        print(dynamic_context.HAVE_WANDB, "wandb.sdk" in sys.modules)
        import wandb
        print(callable(wandb.init), "wandb.sdk" in sys.modules, type(sys.modules["wandb"]).__name__)
    """, tmp_path)
    assert out == ["True", "False", "True", "True", "module"]


def _package(tmp_path):
    pkg = tmp_path / "site" / "slowpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("import sys\nsys.stdout.write('RAN ')\nVALUE = 7\n")
    (pkg / "sub.py").write_text("from slowpkg import VALUE\nDOUBLE = 2 * VALUE\n")
    return tmp_path / "site"


def test_a_deferred_package_runs_on_first_use_once(tmp_path):
    site = _package(tmp_path)
    out = _run("""
        from hybridrl._startup import defer
        print(defer("slowpkg"), defer("slowpkg"))
        import slowpkg
        print("imported")
        print(slowpkg.VALUE, slowpkg.VALUE)
        import slowpkg.sub
        print(slowpkg.sub.DOUBLE, sys.modules["slowpkg"].sub is sys.modules["slowpkg.sub"])
    """, tmp_path, site)
    assert out == ["True", "False", "imported", "RAN", "7", "7", "14", "True"]


def test_a_submodule_import_loads_the_deferred_package_first(tmp_path):
    site = _package(tmp_path)
    out = _run("""
        from hybridrl._startup import defer
        defer("slowpkg")
        from slowpkg.sub import DOUBLE
        print(DOUBLE, type(sys.modules["slowpkg"]).__name__, sys.modules["slowpkg"].VALUE)
    """, tmp_path, site)
    assert out == ["RAN", "14", "module", "7"]


def test_a_package_that_is_not_installed_stays_absent(tmp_path):
    out = _run("""
        from hybridrl._startup import defer
        print(defer("no_such_package_here"))
        try:
            import no_such_package_here
        except ImportError:
            print("ImportError")
    """, tmp_path)
    assert out == ["False", "ImportError"]


def test_megatron_imports_without_the_compiler(tmp_path):
    """megatron-core's ~40 import-time torch.compile decorations no longer import torch._dynamo/_inductor
    (about 2.5 s of CPU per rank) on a CPU; torch.compile is torch's own again afterwards; a deferred function
    compiles at its first call, with its options, and gives the uncompiled function's result."""
    out = _run("""
        import hybridrl, torch
        real = torch.compile
        import megatron.core, megatron.core.models.gpt
        from megatron.core import jit
        print(any(m.startswith(("torch._dynamo", "torch._inductor")) for m in sys.modules), torch.compile is real,
              jit.jit_fuser is not real)

        @jit.jit_fuser
        def gated(x, y):
            return torch.nn.functional.silu(x) * y

        x, y = torch.randn(4, 8), torch.randn(4, 8)
        print(any(m.startswith("torch._dynamo") for m in sys.modules))
        eager = jit.jit_fuser(gated.__wrapped__, backend="eager")
        print(torch.equal(eager(x, y), torch.nn.functional.silu(x) * y),
              any(m.startswith("torch._dynamo") for m in sys.modules), eager.__name__)
    """, tmp_path)
    assert out == ["False", "True", "True", "False", "True", "True", "gated"]
