"""The public surface is ``decisiond.__all__`` and nothing else: the top-level package exports exactly what the
Python API page (``docs/reference/python.md``) promises, every name it lists exists, and no internal module
declares an ``__all__`` of its own (so nothing inside reads as public API)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import decisiond

PYTHON_API = Path(__file__).resolve().parents[1] / "docs" / "reference" / "python.md"

# Modules the walk must find (a broken walk would make every test below vacuous).
EXPECTED = {
    "decisiond.cli",
    "decisiond.engine.backends.base",
    "decisiond.engine.backends.transformers",
    "decisiond.engine.local",
    "decisiond.gateway.providers.base",
    "decisiond.gateway.stages.budget",
    "decisiond.server.app",
}


def _module_names() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(decisiond.__path__, "decisiond."):
        if not info.name.startswith("decisiond.store.migrations"):  # Alembic loads these by file path
            names.append(info.name)
    return sorted(names)


INTERNAL = _module_names()


def test_walk_finds_the_whole_tree():
    on_disk = {
        "decisiond." + ".".join(path.relative_to(Path(decisiond.__file__).parent).with_suffix("").parts)
        for path in Path(decisiond.__file__).parent.rglob("*.py")
    }
    on_disk = {name.removesuffix(".__init__") for name in on_disk if "migrations" not in name}
    assert on_disk - {"decisiond"} <= set(INTERNAL)
    assert EXPECTED <= set(INTERNAL)


@pytest.mark.parametrize("name", INTERNAL)
def test_internal_module_declares_no_all(name: str):
    module = importlib.import_module(name)
    assert not hasattr(module, "__all__"), f"{name} declares __all__; only decisiond/__init__.py does"


def test_all_lists_only_names_that_exist():
    exported = decisiond.__all__
    assert len(set(exported)) == len(exported)
    assert [item for item in exported if not hasattr(decisiond, item)] == []
    namespace: dict[str, object] = {}
    exec("from decisiond import *", namespace)
    assert set(exported) <= set(namespace)


def test_exceptions_form_one_tree():
    errors = [getattr(decisiond, n) for n in decisiond.__all__ if isinstance(getattr(decisiond, n), type)
              and issubclass(getattr(decisiond, n), BaseException)]
    assert decisiond.DecisionError in errors and len(errors) >= 10
    assert all(issubclass(e, decisiond.DecisionError) for e in errors)
    assert issubclass(decisiond.ProviderTimeout, decisiond.Timeout)
    assert issubclass(decisiond.LimitExceeded, decisiond.InvalidRequest)
    # A plain exception class: compares by identity and hashes (a dataclass compared by value and did not).
    a, b = decisiond.RateLimited("slow down", 1.5), decisiond.RateLimited("slow down", 1.5)
    assert a != b and len({a, b}) == 2
    assert (a.status, a.code, a.headers["retry-after-ms"]) == (429, "rate_limit_exceeded", "1500")


def test_top_level_exports_match_the_package_namespace_and_the_readme():
    # httpx-style: every public attribute of the package is in __all__ and vice versa (submodules aside) ...
    attributes = {
        name for name, value in vars(decisiond).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    }
    assert attributes == set(decisiond.__all__) - {"__version__"}
    assert list(decisiond.__all__) == sorted(decisiond.__all__)
    # ... and the list is the one the Python API page promises.
    section = PYTHON_API.read_text().split("<!-- library-names -->")[1]
    assert set(decisiond.__all__) == set(re.findall(r"`([A-Za-z_]+)`", section))
