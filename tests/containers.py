"""Real containers for the tests, with podman: the base image made here, decisiond's images built from its
``Containerfile``, containers run on the host's network and stopped.

No image registry is reachable from these machines, so ``python:3.11-slim-bookworm`` is made here (``base_image``):
``debootstrap --variant=minbase`` of Debian bookworm with Python, pip and venv, from the mirror apt uses, imported under
the official name with ``python`` and ``pip`` on ``PATH`` and no PEP 668 ``EXTERNALLY-MANAGED`` marker, as the official
image has. An image already in podman's store under that name is used as it is.

The build gets this machine's pip settings (``pip config list``: its CA bundle, its folders of local wheels, the one
that holds torch among them, a proxy) through mounts, with a ``pip.conf`` that names them mounted at
``/etc/pip.conf``: what a build host behind a proxy does. The Containerfile's own stage runs no command, so none of
it reaches the image.

podman here needs ``--runtime runc --cgroup-manager=cgroupfs``, ``default_ulimits = []`` (a ``containers.conf`` of
the tests', named by ``CONTAINERS_CONF``) and ``--network host``. Where podman, runc or debootstrap cannot run, a
test is skipped on a developer's machine and fails under ``CI=true`` (``.ci/run`` installs all three).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from services import unavailable

ROOT = Path(__file__).resolve().parents[1]
BASE = "docker.io/library/python:3.11-slim-bookworm"
SUITE = "bookworm"
PACKAGES = "python3,python3-venv,python3-pip,ca-certificates"
RUNTIME = ["--runtime", "runc", "--cgroup-manager=cgroupfs"]
MOUNTS = "/run/host-pip"  # where the build sees the host's pip files


@dataclass
class Podman:
    """podman with the flags and ``containers.conf`` these machines need; ``run`` raises on a failure, with what
    podman printed."""

    folder: Path
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def make(cls) -> "Podman":
        missing = [tool for tool in ("podman", "runc", "debootstrap") if shutil.which(tool) is None]
        if missing:
            unavailable(f"{', '.join(missing)} not installed (Debian packages podman, runc, debootstrap)")
        if os.geteuid() != 0:
            unavailable("podman with runc and debootstrap run as root here")
        folder = Path(tempfile.mkdtemp(prefix="decisiond-podman-"))
        (folder / "containers.conf").write_text("[containers]\ndefault_ulimits = []\n")
        podman = cls(folder, {**os.environ, "CONTAINERS_CONF": str(folder / "containers.conf")})
        info = podman.run("info", "--format", "{{.Store.GraphDriverName}}", check=False, timeout=120)
        if info.returncode != 0:
            unavailable(f"podman cannot run here: {info.stderr.strip()[-500:]}")
        return podman

    def run(self, *args: str, check: bool = True, timeout: float = 600,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["podman", *RUNTIME, *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, input=input)
        if check:
            self.check(done)
        return done

    @staticmethod
    def check(done: subprocess.CompletedProcess[str]) -> None:
        """Raise where ``done`` (a ``run`` with ``check=False``) failed, with what podman printed."""
        if done.returncode != 0:
            args = done.args[1 + len(RUNTIME):]
            raise RuntimeError(f"podman {' '.join(args[:3])} … exited {done.returncode}:\n{done.stderr[-3000:]}")

    def exists(self, image: str) -> bool:
        return self.run("image", "exists", image, check=False).returncode == 0

    def size(self, image: str) -> int:
        """The image's size in bytes, its base's layers included, as ``podman images`` counts it."""
        return int(self.run("image", "inspect", "--format", "{{.Size}}", image).stdout.strip())

    def inspect(self, what: str) -> dict:
        return json.loads(self.run("inspect", what).stdout)[0]

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def debian_mirror() -> str | None:
    """The Debian mirror apt uses for bookworm's main (deb822 ``.sources`` or one-line ``.list`` files), else None
    (debootstrap's own default)."""
    files = ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.sources")),
             *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]
    for path in files:
        try:
            text = Path(path).read_text()
        except OSError:
            continue
        for stanza in re.split(r"\n\s*\n", text):
            fields = {k.strip().lower(): v.split() for k, _, v in
                      (line.partition(":") for line in stanza.splitlines() if ":" in line and not line.startswith("#"))}
            if "deb" in fields.get("types", []) and SUITE in fields.get("suites", []) and fields.get("uris"):
                return fields["uris"][0]
        for line in text.splitlines():
            words = re.sub(r"\[[^]]*\]", "", line).split()
            if len(words) >= 3 and words[0] == "deb" and words[2] == SUITE:
                return words[1]
    return None


def base_image(podman: Podman) -> float:
    """Make ``python:3.11-slim-bookworm`` unless podman has it; the seconds it took (0 when it was there)."""
    if podman.exists(BASE):
        return 0.0
    started = time.monotonic()
    root = podman.folder / "rootfs"
    command = ["debootstrap", "--variant=minbase", f"--include={PACKAGES}", SUITE, str(root)]
    mirror = debian_mirror()
    done = subprocess.run(command + ([mirror] if mirror else []), capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        unavailable(f"debootstrap failed: {(done.stdout + done.stderr)[-1500:]}")
    for name, target in (("python", "/usr/bin/python3"), ("pip", "/usr/bin/pip3")):
        (root / "usr/local/bin" / name).symlink_to(target)
    for marker in root.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
        marker.unlink()
    for leftover in [*root.glob("var/cache/apt/archives/*.deb"), *root.glob("var/lib/apt/lists/*_*")]:
        leftover.unlink()
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    try:
        imported = subprocess.run(
            ["podman", *RUNTIME, "import", "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
             "--change", "ENV LANG=C.UTF-8", "--change", 'CMD ["python3"]', "-", BASE],
            stdin=tar.stdout, env=podman.env, capture_output=True, text=True, timeout=600)
    finally:
        tar.wait()
        shutil.rmtree(root, ignore_errors=True)
    if imported.returncode != 0:
        raise RuntimeError(f"podman import failed: {imported.stderr[-2000:]}")
    return time.monotonic() - started


def pip_settings() -> dict[str, list[str]]:
    """This machine's pip settings that a build needs, as ``pip config list`` shows them: ``cert``, ``find-links``,
    ``index-url``, ``extra-index-url``, ``proxy`` and ``trusted-host``, each a list of values."""
    listed = subprocess.run(["python3", "-m", "pip", "config", "list"], capture_output=True, text=True,
                            timeout=60).stdout
    wanted = ("cert", "find-links", "index-url", "extra-index-url", "proxy", "trusted-host")
    found: dict[str, list[str]] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        name = key.rpartition(".")[2]
        if name in wanted:
            for item in value.strip().strip("'\"").split():
                if item not in found.setdefault(name, []):
                    found[name].append(item)
    return found


def build_mounts(folder: Path) -> list[str]:
    """``-v`` arguments giving a build this machine's pip settings: its CA bundle and its local folders of wheels
    (or index folders) mounted under ``MOUNTS``, and a ``pip.conf`` naming them at ``/etc/pip.conf``."""
    settings = pip_settings()
    mounts: list[str] = []
    lines = ["[global]"]

    def local(path: str, name: str) -> str:
        mounts.extend(["-v", f"{path}:{MOUNTS}/{name}:ro"])
        return f"{MOUNTS}/{name}"

    for cert in settings.get("cert", [])[:1]:
        if Path(cert).is_file():
            lines.append(f"cert = {local(cert, 'ca.crt')}")
    for key in ("find-links", "index-url", "extra-index-url"):
        values = []
        for n, value in enumerate(settings.get(key, [])):
            path = value.removeprefix("file://")
            if value.startswith(("http://", "https://")):
                values.append(value)
            elif key == "find-links" and Path(path).is_dir():  # local index folders are the host's own: left out
                values.append(local(path, f"{key}-{n}"))
        if values:
            lines.append(f"{key} = {' '.join(values)}")
    for key in ("proxy", "trusted-host"):
        if settings.get(key):
            lines.append(f"{key} = {' '.join(settings[key])}")
    (folder / "pip.conf").write_text("\n".join(lines) + "\n")
    return mounts + ["-v", f"{folder / 'pip.conf'}:/etc/pip.conf:ro"]


# podman's storage losing a layer it has just written as a build commits a step
# (podman-container-tools/podman#24598, a flake podman's own CI sees; met here once in a full run): the build is tried
# once more.
STORAGE_FLAKES = ("layer not known", "identifier is not a container")


def build(podman: Podman, variant: str, tag: str, cache: bool = True) -> float:
    """Build the Containerfile's ``variant`` (``engine`` or ``gateway``) as ``tag``, on podman's cache of earlier
    builds unless ``cache`` is false; the seconds it took."""
    started = time.monotonic()
    args = ["build", *([] if cache else ["--no-cache"]), "--network", "host", "--format", "docker", "--pull=never",
            "--build-arg", f"VARIANT={variant}", *build_mounts(podman.folder), "-t", tag, "-f",
            str(ROOT / "Containerfile"), str(ROOT)]
    done = podman.run(*args, check=False, timeout=1800)
    if done.returncode != 0 and any(flake in done.stderr for flake in STORAGE_FLAKES):
        done = podman.run(*args, check=False, timeout=1800)  # once more: podman's own flake, not the Containerfile
    podman.check(done)
    return time.monotonic() - started


@dataclass
class Container:
    """A detached container of the tests; ``stop`` stops it with ``podman stop`` and gives the seconds it took."""

    podman: Podman
    name: str

    def logs(self) -> str:
        done = self.podman.run("logs", self.name, check=False)
        return done.stdout + done.stderr

    def exec(self, *command: str) -> subprocess.CompletedProcess[str]:
        return self.podman.run("exec", self.name, *command, check=False)

    def stop(self, timeout: int = 30) -> float:
        started = time.monotonic()
        self.podman.run("stop", "-t", str(timeout), self.name, timeout=timeout + 60)
        return time.monotonic() - started

    def exit_code(self) -> int:
        return int(self.podman.inspect(self.name)["State"]["ExitCode"])

    def remove(self) -> None:
        self.podman.run("rm", "-f", "-v", self.name, check=False, timeout=120)


def start(podman: Podman, image: str, env: dict[str, str], *args: str, volumes: list[str] | None = None) -> Container:
    """Run ``image`` detached on the host's network with ``env`` (given with ``--env``: in the container's
    configuration, never in a layer) and ``volumes`` (``-v`` values)."""
    name = f"decisiond-test-{uuid.uuid4().hex[:10]}"
    options = [item for key, value in env.items() for item in ("--env", f"{key}={value}")]
    options += [item for volume in volumes or [] for item in ("-v", volume)]
    podman.run("run", "-d", "--name", name, "--network", "host", *options, image, *args)
    return Container(podman, name)
