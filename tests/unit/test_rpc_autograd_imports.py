"""The import graph runs one way, ``tdist.autograd`` -> ``tdist.rpc``: no module of rpc imports
autograd at import time (autograd plugs into ``rpc._hooks`` when it is imported), and either
package can be imported first in a fresh process."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

import tdist

pytestmark = pytest.mark.timeout(60)

SRC = pathlib.Path(tdist.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_time_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every import a module runs when it is imported: its top level,
    class bodies and ``if``/``try`` blocks, ``if TYPE_CHECKING`` included; not function bodies,
    which run later (a lazy import there makes no cycle)."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            found.append((node.lineno, module))
            found.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_no_module_of_rpc_imports_autograd() -> None:
    files = sorted((SRC / "rpc").rglob("*.py"))
    assert len(files) > 10
    offending = [
        f"{path.relative_to(SRC.parent)}:{line}: {module}"
        for path in files
        for line, module in _import_time_imports(path)
        if module == "tdist.autograd" or module.startswith("tdist.autograd.")
    ]
    assert offending == []
    # the check resolves relative imports: it finds autograd's (``from ..rpc import _hooks``)
    found = {module for _, module in _import_time_imports(SRC / "autograd" / "_context.py")}
    assert {"tdist.rpc", "tdist.rpc._hooks"} <= found


def _python(code: str) -> list[str]:
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert res.returncode == 0, res.stderr
    return res.stdout.split()


def test_importing_rpc_loads_no_autograd_until_asked() -> None:
    out = _python(
        "import importlib, pkgutil, sys\n"
        "import tdist.rpc\n"
        "for m in pkgutil.walk_packages(tdist.rpc.__path__, 'tdist.rpc.'):\n"
        "    importlib.import_module(m.name)\n"
        "from tdist.rpc import _hooks\n"
        "print(any(m.startswith('tdist.autograd') for m in sys.modules), _hooks.autograd)\n"
        "hooks = _hooks.load_autograd()\n"  # (what RRef.backward's owner, _get_debug_info do)
        "import tdist.autograd._context as c\n"
        "print(hooks is c is _hooks.autograd, hooks._get_debug_info() == "
        "{'num_autograd_contexts': 0, 'num_current_backward_passes': 0})\n"
    )
    assert out == ["False", "None", "True", "True"]


@pytest.mark.parametrize("first", ["tdist.autograd", "tdist.autograd._context", "tdist.optim"])
def test_autograd_imported_first_imports_rpc_and_registers(first: str) -> None:
    out = _python(
        f"import {first}\n"
        "import sys\n"
        "from tdist.rpc import _hooks\n"
        "print('tdist.rpc._api' in sys.modules, _hooks.autograd is sys.modules['tdist.autograd._context'])\n"
    )
    assert out == ["True", "True"]
