"""Print the requirements of decisiond's ``pyproject.toml``, one a line, for pip's ``-r``: the base install's (the
gateway) and those of each extra named. The Containerfile installs them in a layer of their own, before the
source is copied, so that a change to the code rebuilds only the layers after it.

    python deploy/requirements.py pyproject.toml            # the gateway
    python deploy/requirements.py pyproject.toml engine     # the engine extra alone
"""

from __future__ import annotations

import sys

import tomllib


def requirements(pyproject: str, extras: list[str]) -> list[str]:
    """The base requirements when ``extras`` is empty, else those of the extras named (an unknown one is an error)."""
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    if not extras:
        return list(project["dependencies"])
    optional = project["optional-dependencies"]
    unknown = [name for name in extras if name not in optional]
    if unknown:
        raise SystemExit(f"requirements.py: no extra {unknown[0]!r} in {pyproject} (extras: {', '.join(optional)})")
    return [line for name in extras for line in optional[name]]


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    print("\n".join(requirements(sys.argv[1], sys.argv[2:])))
