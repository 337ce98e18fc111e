"""The import graph of ``src/decisiond``, computed from the source: every ``import`` statement counts, those inside
functions included (only ``if TYPE_CHECKING:`` blocks, which import for types alone, are left out). No cycle may
exist anywhere, and the gateway's modules import only from their own layer or the layers before it, as the list at
the top of ``gateway/__init__.py`` says."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "decisiond"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return skip


def _known(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # ``from pkg import sub`` imports the submodule when there is one, else a name of pkg.
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in MODULES else origin
                       for alias in node.names]
        for target in targets:
            if target == "decisiond" or target.startswith("decisiond."):
                known = _known(target)
                if known is not None and known != module:
                    found.add(known)
    return found


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read():
    # Guards against a parser that finds nothing (which would make the tests below pass vacuously).
    assert len(MODULES) > 60
    assert "decisiond.gateway.router" in GRAPH["decisiond.gateway.service"]
    assert "decisiond.gateway.providers" in GRAPH["decisiond.gateway.config"]


def test_no_import_cycle_anywhere():
    assert _cycles(GRAPH) == []


def test_a_cycle_would_be_found():
    graph = {k: set(v) for k, v in GRAPH.items()}
    graph["decisiond.errors"].add("decisiond.gateway.service")
    assert any("decisiond.errors" in c and "decisiond.gateway.service" in c for c in _cycles(graph))


def _layers() -> list[tuple[str, set[str]]]:
    """The numbered layer list in gateway/__init__.py: ``N. name: file.py other.py package/``, the files going on
    over indented lines until the layer's description (``— …``)."""
    doc = ast.get_docstring(ast.parse((PACKAGE / "gateway" / "__init__.py").read_text())) or ""
    layers = []
    for match in re.finditer(r"^(\d+)\. (\w+): (.+(?:\n {3}(?!—).+)*)$", doc, re.M):
        members = set()
        for entry in match.group(3).split():
            name = "decisiond.gateway." + entry.removesuffix(".py").rstrip("/").replace("/", ".")
            members.add(name)
        layers.append((match.group(2), members))
    return layers


def _layer_of(module: str, layers: list[tuple[str, set[str]]]) -> int | None:
    for i, (_, members) in enumerate(layers):
        if any(module == m or module.startswith(m + ".") for m in members):
            return i
    return None


def test_every_gateway_module_has_a_layer():
    layers = _layers()
    assert [name for name, _ in layers] == ["types", "providers", "config", "router", "stages", "service"]
    gateway = [m for m in MODULES if m.startswith("decisiond.gateway.")]
    assert [m for m in gateway if _layer_of(m, layers) is None] == []
    for _, members in layers:
        assert all(m in MODULES for m in members), members


def test_gateway_layers_import_only_downwards():
    layers = _layers()
    upward = []
    for module, deps in GRAPH.items():
        mine = _layer_of(module, layers)
        if mine is None:
            continue
        for dep in deps:
            theirs = _layer_of(dep, layers)
            if theirs is not None and theirs > mine:
                upward.append(f"{module} ({layers[mine][0]}) imports {dep} ({layers[theirs][0]})")
    assert upward == []


def test_nothing_below_the_http_surfaces_imports_them():
    lower = [m for m in MODULES if m.startswith(("decisiond.gateway", "decisiond.engine", "decisiond.dialects"))]
    assert [(m, d) for m in lower for d in GRAPH[m] if d.startswith(("decisiond.server", "decisiond.cli"))] == []
