"""The layering of DESIGN.md, measured on the code: what imports what."""

import pkgutil
import subprocess
import sys

import inflight.protocol
import inflight.runtime.host


def _modules(package) -> list[str]:
    return [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]


def test_the_torch_free_half_imports_no_torch():
    """The protocol, the engine and the runtime's host half run without torch."""
    modules = ["inflight.engine", *_modules(inflight.protocol), *_modules(inflight.runtime.host)]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
