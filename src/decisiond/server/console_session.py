"""The console's sessions, and how they authorize the admin API.

- **A session** is a cookie (``decisiond_console``: HttpOnly, SameSite=Strict, Path=/, Secure over https) holding a
  signed token (JWS, HS256, by ``joserfc``) of who signed in (``sub``), the role (``admin`` or ``read_only``), how
  (``master_key`` or ``oidc``), a random session id and its expiry. It holds no secret: not the master key, not an
  identity provider's token. The signing key is derived from ``console.session_secret``, else from the master key
  (a new master key ends every session). Signing out forgets the session id in this process (others see the
  cookie deleted from the browser, and any copy of it ends with its expiry).
- **The admin API** (``admin_caller``): a request that carries ``Authorization`` is the bearer API, unchanged (the
  master key, else refused). One without it but with a session cookie is the console's: any role may read (GET);
  a change (any other method) needs the admin role (403 ``read_only_session``), the session's CSRF token in
  ``X-CSRF-Token`` (403 ``csrf_failed``) and, where the browser says where it came from, this same origin.
- **Sign-in attempts are bounded** (``SignInLimiter``): failures per client address per minute, and ten times as many
  from all addresses together; past either, every attempt is refused with 429 until the minute is over.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from fastapi import Request
from fastapi.responses import Response
from joserfc import jwt
from joserfc.errors import JoseError
from joserfc.jwk import OctKey

from ..errors import AuthenticationFailed, PermissionDenied, RateLimited
from ..gateway.console_settings import ConsoleConfig
from ..gateway.stages.auth import Authenticator
from ..gateway.types import Caller

log = logging.getLogger("decisiond.console")

COOKIE = "decisiond_console"
CSRF_HEADER = "x-csrf-token"
ROLES = ("admin", "read_only")
READS = ("GET", "HEAD")
SESSION_ALGORITHM = ["HS256"]
WINDOW_S = 60.0
REVOKED_MAX = 10_000


@dataclass(frozen=True)
class Session:
    """A signed-in console user: ``subject`` (``master`` or the identity provider's name for them), ``role``,
    ``via`` (``master_key`` or ``oidc``), the session id and its expiry (Unix seconds), and its CSRF token (derived
    from the id: never stored, never in the cookie)."""

    sid: str
    subject: str
    role: str
    via: str
    expires: int
    csrf: str

    def public(self) -> dict[str, Any]:
        return {"subject": self.subject, "role": self.role, "via": self.via, "expires_at": self.expires,
                "csrf_token": self.csrf}


class Sessions:
    """Issues and reads signed tokens: the session cookie's (``use: session``) and the single sign-on's short-lived
    login state (``use: oidc_login``); a token of one use is never accepted as the other."""

    def __init__(self, secret: bytes, ttl_s: int, oidc: bool, clock: Callable[[], float] = time.time):
        self._key = OctKey.import_key(hmac.new(secret, b"decisiond console session v1", hashlib.sha256).digest())
        self._csrf_key = hmac.new(secret, b"decisiond console csrf v1", hashlib.sha256).digest()
        self.ttl_s = ttl_s
        self.oidc = oidc
        self.clock = clock
        self._revoked: OrderedDict[str, int] = OrderedDict()

    @classmethod
    def of(cls, config: ConsoleConfig, master_key: str | None) -> "Sessions | None":
        """The sessions of a gateway: signed with ``session_secret``, else a key derived from the master key; None
        when neither is set (the console cannot sign anyone in)."""
        secret = config.session_secret or master_key
        if not secret:
            return None
        return cls(secret.encode(), config.session_ttl_s, config.oidc is not None)

    def sign(self, claims: dict[str, Any], use: str, ttl_s: int) -> str:
        now = int(self.clock())
        return jwt.encode({"alg": "HS256"}, {**claims, "use": use, "iat": now, "exp": now + ttl_s}, self._key,
                          algorithms=SESSION_ALGORITHM)

    def unsign(self, token: str, use: str) -> dict[str, Any] | None:
        """The claims of a token this server signed for ``use``, unexpired; None for anything else."""
        if not token or len(token) > 4096:
            return None
        try:
            claims = dict(jwt.decode(token, self._key, algorithms=SESSION_ALGORITHM).claims)
        except (JoseError, ValueError):
            return None
        exp = claims.get("exp")
        if claims.get("use") != use or not isinstance(exp, int) or exp <= self.clock():
            return None
        return claims

    def issue(self, subject: str, role: str, via: str) -> tuple[str, Session]:
        """A new session's cookie value and the session."""
        if role not in ROLES or via not in ("master_key", "oidc"):
            raise ValueError(f"no session of role {role!r} signed in by {via!r}")
        sid = secrets.token_urlsafe(18)
        token = self.sign({"sid": sid, "sub": subject, "role": role, "via": via}, "session", self.ttl_s)
        return token, self._session(sid, subject, role, via, int(self.clock()) + self.ttl_s)

    def read(self, token: str) -> Session | None:
        """The session of a cookie value: signed here, unexpired, not signed out in this process, and of a way of
        signing in still configured (a single sign-on session ends when ``oidc`` is removed)."""
        claims = self.unsign(token, "session")
        if claims is None:
            return None
        sid, subject, role, via = (claims.get(k) for k in ("sid", "sub", "role", "via"))
        if not (isinstance(sid, str) and isinstance(subject, str) and role in ROLES and via in ("master_key", "oidc")):
            return None
        if sid in self._revoked or (via == "oidc" and not self.oidc):
            return None
        return self._session(sid, subject, str(role), str(via), int(claims["exp"]))

    def _session(self, sid: str, subject: str, role: str, via: str, expires: int) -> Session:
        csrf = hmac.new(self._csrf_key, sid.encode(), hashlib.sha256).hexdigest()[:40]
        return Session(sid, subject, role, via, expires, csrf)

    def revoke(self, session: Session) -> None:
        """Sign a session out in this process (until its expiry, after which its token is refused anyway)."""
        now = self.clock()
        while self._revoked and (next(iter(self._revoked.values())) <= now or len(self._revoked) >= REVOKED_MAX):
            self._revoked.popitem(last=False)
        self._revoked[session.sid] = session.expires


class SignInLimiter:
    """Failed sign-ins per client address in a sliding minute (``per_address``), and from all addresses together
    (ten times as many): ``check`` raises 429 once either is reached, for every attempt, right or wrong."""

    def __init__(self, per_address: int, clock: Callable[[], float] = time.monotonic):
        self.per_address = per_address
        self.overall = per_address * 10
        self.clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._all: deque[float] = deque()

    def _recent(self, times: deque[float]) -> deque[float]:
        horizon = self.clock() - WINDOW_S
        while times and times[0] <= horizon:
            times.popleft()
        return times

    def check(self, address: str) -> None:
        mine = self._recent(self._failures.get(address, deque()))
        if len(mine) >= self.per_address or len(self._recent(self._all)) >= self.overall:
            oldest = min(mine[0] if len(mine) >= self.per_address else self.clock(),
                         self._all[0] if len(self._all) >= self.overall else self.clock())
            retry = max(1.0, oldest + WINDOW_S - self.clock())
            raise RateLimited(f"too many failed sign-ins; try again in {retry:.0f} s", retry_after_s=retry,
                              code="sign_in_limited")

    def failed(self, address: str) -> None:
        now = self.clock()
        self._failures.setdefault(address, deque()).append(now)
        self._failures.move_to_end(address)
        self._all.append(now)
        while len(self._failures) > REVOKED_MAX:
            self._failures.popitem(last=False)


def client_address(request: Request) -> str:
    return request.client.host if request.client is not None else "unknown"


def session_or_none(request: Request) -> Session | None:
    """The request's console session, or None (no cookie, or not a live session of this server)."""
    sessions: Sessions | None = request.app.state.console_sessions
    token = request.cookies.get(COOKIE)
    return sessions.read(token) if sessions is not None and token else None


def session_of(request: Request) -> Session:
    """The request's console session, or 401."""
    session = session_or_none(request)
    if session is None:
        raise AuthenticationFailed("No console session, or it has ended: sign in at /console.",
                                   code="console_session_required")
    return session


def _same_origin(request: Request) -> bool:
    """Whether the browser says the request comes from this origin: ``Sec-Fetch-Site`` where it is sent (every
    current browser; a proxy does not change it), else an ``Origin`` naming this host (``Host``, or the
    ``X-Forwarded-Host`` a proxy set); a client that sends neither (not a browser) passes on its CSRF token alone."""
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site in ("same-origin", "none")
    origin = request.headers.get("origin")
    if origin is None:
        return True
    hosts = {request.headers.get(name, "").strip().lower() for name in ("host", "x-forwarded-host")} - {""}
    return (urlsplit(origin).netloc or "").lower() in hosts


def check_change(request: Request, session: Session, needs_admin: bool = True) -> None:
    """A change made with a session: from this same origin (where the browser says: ``Sec-Fetch-Site``,
    ``Origin``), carrying the session's CSRF token, by the admin role (``needs_admin``: signing out needs none)."""
    if not _same_origin(request):
        raise PermissionDenied("a console change must come from the console's own page", code="csrf_failed")
    sent = request.headers.get(CSRF_HEADER, "")
    if not hmac.compare_digest(sent.encode(), session.csrf.encode()):
        raise PermissionDenied(f"a console change needs the session's CSRF token in {CSRF_HEADER}",
                               code="csrf_failed")
    if needs_admin and session.role != "admin":
        raise PermissionDenied(f"{session.subject} is signed in read-only: changes need the admin role",
                               code="read_only_session")


async def admin_caller(request: Request) -> Caller:
    """Who makes an ``/admin/*`` request: with an ``Authorization`` header (or no session cookie), the bearer key as
    before — the master key, else 401/403; else the console session (``check_change`` for anything but a read),
    as the master key, its user written on the request's access line (``console_user``)."""
    gateway = request.app.state.gateway
    if "authorization" in request.headers or COOKIE not in request.cookies:
        caller: Caller = await gateway.auth.authenticate(request.headers)
        Authenticator.require_master(caller)
        return caller
    session = session_of(request)
    if request.method not in READS:
        check_change(request, session)
    request.state.log["console_user"] = session.subject
    return Caller(key_id=None, name=f"console:{session.subject}", master=True)


def set_cookie(response: Response, request: Request, token: str, config: ConsoleConfig) -> None:
    secure = config.secure_cookie if config.secure_cookie is not None else request.url.scheme == "https"
    response.set_cookie(COOKIE, token, max_age=config.session_ttl_s, path="/", httponly=True, samesite="strict",
                        secure=secure)


def clear_cookie(response: Response) -> None:
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
