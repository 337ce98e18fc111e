"""The public surface: every public module under ``src/decisiond`` declares ``__all__`` (CONTRIBUTING.md, "Rules of
the house"), every name it lists exists, and the top-level package exports exactly what the README promises."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path
from types import ModuleType

import pytest

import decisiond

README = Path(__file__).resolve().parents[1] / "README.md"

# Alembic's migration environment and revision scripts are loaded by file path, not imported as API.
NOT_PUBLIC_PREFIXES = ("decisiond.store.migrations",)

# Modules the walk must find (a broken walk would make every test below vacuous).
EXPECTED = {
    "decisiond.cli",
    "decisiond.engine.backend",
    "decisiond.engine.backends.transformers",
    "decisiond.engine.local",
    "decisiond.engine.packing",
    "decisiond.engine.scheduler",
    "decisiond.gateway.providers.base",
}


def _public(name: str) -> bool:
    return not name.startswith(NOT_PUBLIC_PREFIXES) and not any(
        part.startswith("_") for part in name.split(".")[1:])


def _module_names() -> list[str]:
    names = ["decisiond"]
    for info in pkgutil.walk_packages(decisiond.__path__, "decisiond."):
        names.append(info.name)
    return sorted(names)


ALL_MODULES = _module_names()
PUBLIC = [name for name in ALL_MODULES if _public(name)]


def test_walk_finds_the_whole_tree():
    # Guard against the walk silently finding nothing (a broken __path__ would make every test below vacuous).
    on_disk = {
        "decisiond." + ".".join(path.relative_to(Path(decisiond.__file__).parent).with_suffix("").parts)
        for path in Path(decisiond.__file__).parent.rglob("*.py")
    }
    on_disk = {name.removesuffix(".__init__") for name in on_disk}
    expected = {name for name in on_disk if _public(name)}
    assert expected <= set(PUBLIC)
    for name in EXPECTED:
        assert name in PUBLIC, name
    assert not [name for name in PUBLIC if "migrations" in name]


def _load(name: str) -> ModuleType:
    return importlib.import_module(name)


@pytest.mark.parametrize("name", PUBLIC)
def test_public_module_declares_all(name: str):
    module = _load(name)
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    assert isinstance(exported, (list, tuple)), name
    assert all(isinstance(item, str) for item in exported), name
    assert len(set(exported)) == len(exported), f"{name}.__all__ lists a name twice"
    missing = [item for item in exported if not hasattr(module, item)]
    assert not missing, f"{name}.__all__ lists names it does not define: {missing}"
    # `from module import *` must work, which is exactly "every name exists", checked the way Python does it.
    namespace: dict[str, object] = {}
    exec(f"from {name} import *", namespace)
    assert set(exported) <= set(namespace), name


def test_top_level_exports_match_the_package_namespace_and_the_readme():
    # httpx-style: every public attribute of the package is in __all__ and vice versa (submodules aside) ...
    attributes = {
        name for name, value in vars(decisiond).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    }
    assert attributes == set(decisiond.__all__) - {"__version__"}
    assert list(decisiond.__all__) == sorted(decisiond.__all__)
    # ... and the list is the one the README promises.
    section = README.read_text().split("<!-- library-names -->")[1]
    assert set(decisiond.__all__) == set(re.findall(r"`([A-Za-z_]+)`", section))
