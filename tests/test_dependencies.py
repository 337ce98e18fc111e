"""The dependency floors in ``pyproject.toml`` are versions that work: each floor this project relies on is at
least the release that brought what it uses, and what is installed satisfies every requirement."""

from __future__ import annotations

import inspect
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

# What each floor rests on: a lower floor installs a combination that does not run.
FLOORS = {
    "torch": ("2.6", "transformers 5 turns PyTorch off below 2.6; the decoder passes SDPA's enable_gqa (2.5)"),
    "transformers": ("5.0", "logits_to_keep, the cache protocol and attention interfaces of transformers 5"),
    "pydantic": ("2.7", "pydantic v2 models and validators"),
    "sqlalchemy": ("2.0", "SQLAlchemy 2's async engine"),
    "limits": ("5.0", "the limits 5 async storage API"),
}


def requirements() -> dict[str, Requirement]:
    """The base install's requirements (the gateway) and the engine extra's (a model served here)."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    out = {}
    for line in project["dependencies"] + project["optional-dependencies"]["engine"]:
        requirement = Requirement(line)
        out[requirement.name.lower()] = requirement
    return out


def floor(requirement: Requirement) -> Version | None:
    lows = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==", "~=")]
    return max(lows) if lows else None


@pytest.mark.parametrize("name", sorted(FLOORS))
def test_each_floor_is_a_release_that_works(name):
    needed, why = FLOORS[name]
    found = floor(requirements()[name])
    assert found is not None and found >= Version(needed), f"{name}: the floor must be {needed} or later ({why})"


def test_the_torch_floor_is_at_least_what_the_installed_transformers_requires():
    from transformers.utils import import_utils

    source = inspect.getsource(import_utils)
    required = re.search(r"PyTorch >= ([0-9.]+) is required", source)
    assert required, "transformers no longer says which torch it requires: read import_utils and update this test"
    assert floor(requirements()["torch"]) >= Version(required.group(1))


def test_what_is_installed_satisfies_every_requirement():
    for name, requirement in requirements().items():
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        installed = Version(metadata.version(name))
        assert requirement.specifier.contains(installed, prereleases=True), f"{name} {installed}: {requirement}"
