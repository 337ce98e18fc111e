"""Who is calling: ``Authorization: Bearer <key>`` checked against the master key, the keys listed in the YAML
and the managed keys in the database. Runs before the body is read; every route but ``/health`` needs a key
once any key is configured. No key, a wrong, revoked or expired one → 401 in the route's dialect.

A caller's user path is its key's; the master key (or anyone, when no key is configured) may name one with
``X-Decisiond-User-Path``, and a key may narrow its own path to a sub-path (``/team/alpha`` → ``/team/alpha/bob``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import replace

from ...errors import AuthenticationFailed, InvalidRequest, PermissionDenied
from ...store.keys import KeyRecord, KeyStore
from ..access_settings import RateLimitConfig, StaticKeyConfig, check_user_path
from ..types import Caller

log = logging.getLogger("decisiond.auth")

USER_PATH_HEADER = "x-decisiond-user-path"
# Verified managed keys are remembered this long (a revocation on another replica is seen within it).
CACHE_SECONDS = 5.0
CACHE_ENTRIES = 10_000


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def bearer(headers: Mapping[str, str]) -> str | None:
    value = headers.get("authorization")
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def in_subtree(path: str, root: str) -> bool:
    """``/team/alpha/bob`` is in ``/team/alpha`` and in ``/``; ``/team/alphabet`` is not in ``/team/alpha``."""
    root = root.rstrip("/")
    return path == root or path.startswith(root + "/") or root == ""


def _static_caller(static: StaticKeyConfig) -> Caller:
    return Caller(key_id=f"static:{static.name}", name=static.name, user_path=static.user_path,
                  models=tuple(static.models) if static.models is not None else None,
                  rate_limits=static.rate_limits, guardrails=tuple(static.guardrails))


class Authenticator:
    def __init__(self, master_key: str | None = None, static_keys: list[StaticKeyConfig] | None = None,
                 store: KeyStore | None = None):
        # Only digests are kept: the master key and static keys are not held in clear past start-up.
        self._master = _sha256(master_key) if master_key else None
        self._static = {(k.key_sha256 or _sha256(k.key or "")): k for k in static_keys or []}
        self.store = store
        self._cache: OrderedDict[str, tuple[float, KeyRecord | None]] = OrderedDict()
        self._reading: dict[str, asyncio.Future[KeyRecord | None]] = {}
        self._callers: dict[str, tuple[KeyRecord, Caller]] = {}

    @property
    def enabled(self) -> bool:
        """Keys are required once a master key or any static key is configured."""
        return self._master is not None or bool(self._static)

    async def authenticate(self, headers: Mapping[str, str]) -> Caller:
        caller = await self._caller(headers)
        return self._with_user_path(caller, headers.get(USER_PATH_HEADER))

    async def _caller(self, headers: Mapping[str, str]) -> Caller:
        key = bearer(headers)
        if not self.enabled:
            return Caller(master=False)
        if key is None:
            raise AuthenticationFailed("Missing API key: send it as 'Authorization: Bearer <key>'.")
        digest = _sha256(key)
        if self._master is not None and hmac.compare_digest(digest, self._master):
            return Caller(key_id=None, name="master", master=True)
        static = self._static.get(digest)
        if static is not None:
            return _static_caller(static)
        return self._managed_caller(await self._managed(key, digest))

    async def caller_of(self, key_id: str | None, master: bool = False) -> Caller:
        """The caller a key is now, by its id: what the lines of a batch run as (the key that made it, also after a
        restart). A revoked or expired key, or one no longer configured, is refused (401) as its requests are."""
        if not self.enabled:
            return Caller()
        if master:
            return Caller(key_id=None, name="master", master=True)
        static = next((k for k in self._static.values() if f"static:{k.name}" == key_id), None)
        if static is not None:
            return _static_caller(static)
        if key_id is None or key_id.startswith("static:") or self.store is None:
            raise AuthenticationFailed("The API key that made this batch is no longer configured.")
        return self._managed_caller(await self.store.get(key_id))

    def _managed_caller(self, record: KeyRecord | None) -> Caller:
        if record is None:
            raise AuthenticationFailed("Invalid API key.")
        status = record.status()
        if status == "revoked":
            raise AuthenticationFailed(f"API key {record.id} has been revoked.")
        if status == "expired":
            raise AuthenticationFailed(f"API key {record.id} expired at {record.expires_at:%Y-%m-%dT%H:%M:%SZ}.")
        known = self._callers.get(record.id)
        if known is not None and known[0] is record:  # the same record read: the same caller
            return known[1]
        caller = Caller(key_id=record.id, name=record.name, user_path=record.user_path,
                        models=tuple(record.models) if record.models is not None else None,
                        rate_limits=RateLimitConfig.model_validate(record.rate_limits) if record.rate_limits else None,
                        guardrails=tuple(record.guardrails))
        self._callers[record.id] = (record, caller)
        if len(self._callers) > CACHE_ENTRIES:
            self._callers.pop(next(iter(self._callers)))
        return caller

    async def _managed(self, key: str, digest: str) -> KeyRecord | None:
        """A managed key's record, never older than ``CACHE_SECONDS`` (a revocation elsewhere is seen within it):
        read from the database when there is none that fresh, else from memory — read again beside the request
        once half that old, so that a key in use is always fresh and its requests never wait for the database."""
        if self.store is None:
            return None
        hit = self._cache.get(digest)
        now = time.monotonic()
        if hit is None or hit[0] <= now:
            return await self._verify(key, digest)
        if hit[0] - now < CACHE_SECONDS / 2 and digest not in self._reading:
            reading = asyncio.ensure_future(self._verify(key, digest))
            self._reading[digest] = reading
            reading.add_done_callback(lambda done: self._read_done(digest, done))
        return hit[1]

    async def _verify(self, key: str, digest: str) -> KeyRecord | None:
        store = self.store
        record = await store.verify(key) if store is not None else None
        self._cache[digest] = (time.monotonic() + CACHE_SECONDS, record)
        self._cache.move_to_end(digest)
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return record

    def _read_done(self, digest: str, reading: asyncio.Future[KeyRecord | None]) -> None:
        self._reading.pop(digest, None)
        if not reading.cancelled() and reading.exception() is not None:  # the database: read again when stale
            log.warning("a managed key could not be read again from the database")

    def forget(self) -> None:
        """Drop remembered keys (after a revocation here)."""
        self._cache.clear()

    @staticmethod
    def _with_user_path(caller: Caller, asked: str | None) -> Caller:
        if asked is None:
            return caller
        try:
            check_user_path(asked)
        except ValueError as e:
            raise InvalidRequest(str(e), code="invalid_user_path") from None
        if not (caller.master or caller.key_id is None) and not in_subtree(asked, caller.user_path):
            raise PermissionDenied(f"this key is bound to user path {caller.user_path!r} and may only name paths "
                                   "below it", code="user_path_not_allowed")
        return replace(caller, user_path=asked)

    @staticmethod
    def require_master(caller: Caller) -> None:
        if not caller.master:
            raise PermissionDenied("This route needs the master key.", code="master_key_required")
