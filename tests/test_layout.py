"""The package's shape: no import cycle, lower layers never import upper ones, a short top level, attention backends
that provide the interface the runner uses."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import cb_sync

PACKAGE = Path(cb_sync.__file__).parent

# lowest first; a module belongs to the longest prefix listed, and may import its own layer and those below
LAYERS = [
    ("cb_sync.tuning", "cb_sync.config"),
    ("cb_sync.attention", "cb_sync.sampling", "cb_sync.lora", "cb_sync.model_patching"),
    ("cb_sync.batch_invariant",),
    ("cb_sync.cache",),
    ("cb_sync.scheduler",),
    ("cb_sync.step",),
    ("cb_sync.graphs",),
    ("cb_sync.runner",),
    ("cb_sync.engine",),
    ("cb_sync", "cb_sync.__main__", "cb_sync.integrations", "cb_sync.cli"),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _runtime_imports(node: ast.AST):
    """Every import statement, at module level or in a function, except those under `if TYPE_CHECKING:` (for
    annotations only, never run)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif not (isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING"):
            yield from _runtime_imports(child)


def imported_modules(name: str) -> set[str]:
    """The cb_sync modules that module `name` imports (a package's own module where an import names a package or
    a name in it), relative imports resolved."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        found |= {target for target in targets if target in MODULES}
    return found - {name}


GRAPH = {name: imported_modules(name) for name in MODULES}


def test_imports_are_resolved():
    assert GRAPH["cb_sync.engine.driver"] >= {"cb_sync.runner", "cb_sync.scheduler", "cb_sync.config"}
    assert "cb_sync.attention.triton_kernels" in GRAPH["cb_sync.attention.triton_ops"]    # absolute import
    assert "cb_sync.cache.sizing" in GRAPH["cb_sync.engine.driver"]


def assert_acyclic(graph: dict[str, set[str]], what: str) -> None:
    done, path = set(), []

    def visit(name):
        if name in path:
            pytest.fail(f"{what} cycle: " + " -> ".join(path[path.index(name):] + [name]))
        if name in done:
            return
        path.append(name)
        for target in sorted(graph.get(name, ())):
            visit(target)
        path.pop()
        done.add(name)
    for name in graph:
        visit(name)


def test_no_import_cycle():
    assert_acyclic(GRAPH, "import")


def package(name: str) -> str:
    """The subpackage of cb_sync that module `name` lies in (a top-level module: itself)."""
    return ".".join(name.split(".")[:2])


def test_no_package_import_cycle():
    """Between subpackages too: no package imports one that imports it back, however far round."""
    imports = {}
    for name, targets in GRAPH.items():
        imports.setdefault(package(name), set()).update(package(t) for t in targets if package(t) != package(name))
    assert_acyclic(imports, "package import")


def layer(name: str) -> int:
    matches = [(len(prefix), index) for index, prefixes in enumerate(LAYERS) for prefix in prefixes
               if name == prefix or name.startswith(prefix + ".")]
    assert matches, f"{name} has no layer in LAYERS"
    return max(matches)[1]


def test_lower_layers_never_import_upper_ones():
    upward = [f"{name} imports {target}" for name in MODULES for target in sorted(GRAPH[name])
              if layer(target) > layer(name)]
    assert upward == []


def test_at_most_eight_modules_at_the_top_level():
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top


def _backend_modules():
    from cb_sync.attention import flash_ops, sdpa_paged, triton_ops
    from cb_sync.batch_invariant import attention
    return [sdpa_paged, triton_ops, flash_ops, attention]


@pytest.mark.parametrize("module", _backend_modules(), ids=lambda module: module.__name__)
def test_attention_backends_provide_the_backend_protocol(module):
    from cb_sync.attention.interface import Backend
    assert isinstance(module, Backend)
    assert isinstance(module.DECODE_FOLLOWS_POOLS, bool)
    expected = list(inspect.signature(Backend.store_and_attend).parameters.values())[1:]    # less self
    given = inspect.signature(module.store_and_attend).parameters.values()
    assert [(p.name, p.kind, p.default) for p in given] == [(p.name, p.kind, p.default) for p in expected]
