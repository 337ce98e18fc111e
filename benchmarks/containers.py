"""Measure decisiond's images: the base made here, then each variant built from scratch (``--no-cache``), its build
time and its size, base included and on top of it. Writes nothing; prints a Markdown table for CONTAINERS.md.

    python benchmarks/containers.py                # as root, with podman, runc and debootstrap (.ci/run installs them)

It uses the tests' podman harness (tests/containers.py): the same flags, base image and pip settings as
tests/test_container.py. The base is made only if podman does not have it; ``--remake-base`` removes it first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import containers  # noqa: E402

MB = 1_000_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--remake-base", action="store_true", help="remove the base image first, and time its making")
    parser.add_argument("--variants", default="gateway,engine")
    args = parser.parse_args()
    podman = containers.Podman.make()
    try:
        if args.remake_base:
            podman.run("rmi", "-f", containers.BASE, check=False)
        made = containers.base_image(podman)
        base = podman.size(containers.BASE)
        print(f"base {containers.BASE}: {base / MB:.0f} MB" + (f", made in {made:.0f} s" if made else ", present"))
        print("\n| variant | build from scratch | image | decisiond's layers (image − base) |")
        print("|---|---:|---:|---:|")
        for variant in args.variants.split(","):
            tag = f"localhost/decisiond-bench:{variant}"
            seconds = containers.build(podman, variant, tag, cache=False)
            size = podman.size(tag)
            print(f"| {variant} | {seconds:.0f} s | {size / MB:,.0f} MB | {(size - base) / MB:,.0f} MB |", flush=True)
            podman.run("rmi", "-f", tag, check=False)
    finally:
        podman.remove()


if __name__ == "__main__":
    main()
