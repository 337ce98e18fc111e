"""The server's own settings (``serve``'s flags): its body limits and the address it serves on. A module of their
own, so that the routes read them without importing the app that mounts them."""

from __future__ import annotations

from dataclasses import dataclass

from ..limits import BODY_READ_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES


@dataclass
class Settings:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_read_timeout: float = BODY_READ_TIMEOUT_S
    # The address served on (``serve --host``): a name a server without keys answers to (``guard``).
    host: str | None = None
