"""The operator's console: one page (``web/console.html``, ``console.js``, ``console.css`` and the vendored uPlot)
on the admin API, and its sign-in routes. Every action of the page is an ``/admin/*`` call with the session cookie
(``console_session.admin_caller``); these routes only sign in and out:

- ``GET /console`` → the page (no data in it; strict CSP: scripts, styles and calls to this origin only);
- ``GET /console/session`` → who is signed in (``signed_in``, ``subject``, ``role``, ``via``, ``expires_at``,
  ``csrf_token``, ``stored_models``), and the ways to sign in (``sign_in``);
- ``POST /console/login`` ``master_key`` (a form, or JSON) → the session cookie; JSON for a script, 303 to
  ``/console`` for a plain form; 401 for anything but the master key; 429 past the failures allowed;
- ``POST /console/logout`` (the session and its CSRF token) → the cookie deleted, the session forgotten here;
- ``GET /console/oidc/start`` → 302 to the identity provider (``console_oidc``), with a signed, HttpOnly,
  ``SameSite=Lax`` cookie of the sign-in's state, nonce and PKCE verifier (10 minutes, Path ``/console/oidc``);
- ``GET /console/oidc/callback`` → the session cookie and 303 to ``/console``; a refusal → 303 to
  ``/console?sign_in_error=<code>`` (the reason is logged, never a token).

All of them answer 404 when ``console.enabled`` is false; the OIDC routes 404 without ``console.oidc``.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any
from urllib.parse import parse_qs, urlencode

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from ..errors import AuthenticationFailed, DecisionError, NotFound
from ..gateway.console_settings import ConsoleConfig
from ..gateway.service import Gateway
from . import console_session as sessions
from .boundary import AnsweringRoute, openai_error
from .console_oidc import LoginState, OidcClient, OidcRefused
from .pages import web_file
from .payload import read_body
from .routes import caller_or_none


class ConsoleRoute(AnsweringRoute):
    """A console route: errors in OpenAI's shape, except a refused sign-in that came as a plain form
    (``request.state.sign_in_form``), sent back to the page by a 303 to ``/console?sign_in_error=<code>``."""

    @staticmethod
    def answer(error: DecisionError, request: Request) -> Response:
        if getattr(request.state, "sign_in_form", False):
            return RedirectResponse("/console?" + urlencode({"sign_in_error": error.code}), status_code=303)
        return openai_error(error)


router = APIRouter(prefix="/console", route_class=ConsoleRoute)
log = logging.getLogger("decisiond.console")

LOGIN_COOKIE = "decisiond_console_login"
LOGIN_PATH = "/console/oidc"
LOGIN_TTL_S = 600
LOGIN_BODY_LIMIT = 4096
PAGE_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "x-frame-options": "DENY", "x-content-type-options": "nosniff", "referrer-policy": "no-referrer",
    "cache-control": "no-store"}


def _config(request: Request) -> ConsoleConfig:
    """The console's config, or 404 when it is off."""
    gateway: Gateway = request.app.state.gateway
    if not gateway.config.console.enabled:
        raise NotFound("the console is off (console.enabled: false)", code="not_found")
    return gateway.config.console


def _oidc(request: Request) -> OidcClient:
    _config(request)
    client: OidcClient | None = request.app.state.console_oidc
    if client is None:
        raise NotFound("single sign-on is not configured (console.oidc)", code="not_found")
    return client


def _signer(request: Request) -> sessions.Sessions:
    signer: sessions.Sessions | None = request.app.state.console_sessions
    if signer is None:
        raise AuthenticationFailed("the console needs a master key (or console.session_secret) to sign anyone in",
                                   code="console_unavailable")
    return signer


@router.get("", include_in_schema=False)
async def page(request: Request) -> Response:
    """The console's page: static, no data; the same to everyone."""
    _config(request)
    return Response(web_file("console.html"), media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)


@router.get("/session")
async def current(request: Request) -> Any:
    """Who is signed in: ``{signed_in: true, subject, role, via, expires_at, csrf_token, stored_models, sign_in}``,
    or ``{signed_in: false, sign_in}`` (the ways to sign in: ``master_key``, ``oidc``). No secret: the CSRF token
    is of no use without the HttpOnly cookie, which a page of another origin can neither read nor send (SameSite)."""
    _config(request)
    ways = ["master_key"] + (["oidc"] if request.app.state.console_oidc is not None else [])
    body: dict[str, Any] = {"object": "console.session", "signed_in": False, "sign_in": ways}
    session = sessions.session_or_none(request)
    if session is None:
        return JSONResponse(body, headers={"cache-control": "no-store"})
    gateway: Gateway = request.app.state.gateway
    body.update(signed_in=True, **session.public(), stored_models=sorted(gateway.stored_models))
    return JSONResponse(body, headers={"cache-control": "no-store"})


async def _master_key(request: Request) -> tuple[str | None, bool]:
    """The ``master_key`` a sign-in sent, and whether it came as a plain form (else JSON)."""
    raw = await read_body(request, LOGIN_BODY_LIMIT)
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "application/x-www-form-urlencoded":
        values = parse_qs(raw.decode("utf-8", "replace"), max_num_fields=10).get("master_key")
        return (values[0] if values else None), True
    try:
        document = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError:
        document = {}
    value = document.get("master_key") if isinstance(document, dict) else None
    return (value if isinstance(value, str) else None), False


@router.post("/login")
async def login(request: Request) -> Response:
    """Sign in with the master key: the session cookie (role admin). Anything else, 401 naming ``master_key``."""
    config = _config(request)
    limiter: sessions.SignInLimiter = request.app.state.console_limiter
    address = sessions.client_address(request)
    limiter.check(address)
    key, form = await _master_key(request)
    request.state.sign_in_form = form  # from here on, a refusal goes back to the page (``ConsoleRoute``)
    if not await _is_master(request, key):
        limiter.failed(address)
        log.warning("console sign-in refused", extra={"client": address, "via": "master_key"})
        raise AuthenticationFailed("master_key: not the master key", ("master_key",), code="invalid_master_key")
    token, session = _signer(request).issue("master", "admin", "master_key")
    log.info("console sign-in", extra={"subject": session.subject, "role": session.role, "via": session.via})
    response: Response = RedirectResponse("/console", status_code=303) if form else JSONResponse(
        {"object": "console.session", **session.public()})
    sessions.set_cookie(response, request, token, config)
    return response


async def _is_master(request: Request, key: str | None) -> bool:
    if not key or len(key) > 1024:
        return False
    caller = await caller_or_none(request.app.state.gateway, {"authorization": f"Bearer {key}"})
    return caller is not None and caller.master


@router.post("/logout")
async def logout(request: Request) -> Response:
    """Sign out: the session (with its CSRF token, from this origin) is forgotten and its cookie deleted."""
    _config(request)
    session = sessions.session_of(request)
    sessions.check_change(request, session, needs_admin=False)
    _signer(request).revoke(session)
    log.info("console sign-out", extra={"subject": session.subject, "via": session.via})
    response = JSONResponse({"object": "console.session", "signed_out": True})
    sessions.clear_cookie(response)
    return response


def _redirect_uri(request: Request, client: OidcClient) -> str:
    return client.config.redirect_uri or str(request.url_for("oidc_callback"))


@router.get("/oidc/start")
async def oidc_start(request: Request) -> Response:
    """To the identity provider, with the sign-in's state in a signed cookie (``SameSite=Lax``: it must come back
    with the provider's redirect)."""
    try:
        client = _oidc(request)
        config = _config(request)
        request.app.state.console_limiter.check(sessions.client_address(request))
        url, login_state = await client.start(_redirect_uri(request, client))
    except OidcRefused as refused:
        log.warning("console single sign-on unavailable", extra={"reason": refused.message})
        return RedirectResponse("/console?" + urlencode({"sign_in_error": refused.code}), status_code=303)
    cookie = _signer(request).sign({"state": login_state.state, "nonce": login_state.nonce,
                                    "verifier": login_state.verifier}, "oidc_login", LOGIN_TTL_S)
    response = RedirectResponse(url, status_code=302)
    secure = config.secure_cookie if config.secure_cookie is not None else request.url.scheme == "https"
    response.set_cookie(LOGIN_COOKIE, cookie, max_age=LOGIN_TTL_S, path=LOGIN_PATH, httponly=True, samesite="lax",
                        secure=secure)
    return response


@router.get("/oidc/callback", name="oidc_callback")
async def oidc_callback(request: Request) -> Response:
    """Back from the identity provider: the code is exchanged and its ID token checked (``console_oidc``); the
    session cookie, or ``/console?sign_in_error=<code>``."""
    client = _oidc(request)
    config = _config(request)
    limiter: sessions.SignInLimiter = request.app.state.console_limiter
    address = sessions.client_address(request)
    limiter.check(address)
    signer = _signer(request)
    try:
        identity = await _identity(request, client, signer)
    except OidcRefused as refused:
        limiter.failed(address)
        log.warning("console sign-in refused", extra={"client": address, "via": "oidc", "code": refused.code,
                                                      "reason": refused.message})
        response = RedirectResponse("/console?" + urlencode({"sign_in_error": refused.code}), status_code=303)
        response.delete_cookie(LOGIN_COOKIE, path=LOGIN_PATH)
        return response
    token, session = signer.issue(identity.name, identity.role, "oidc")
    log.info("console sign-in", extra={"subject": session.subject, "role": session.role, "via": "oidc"})
    response = RedirectResponse("/console", status_code=303)
    response.delete_cookie(LOGIN_COOKIE, path=LOGIN_PATH)
    sessions.set_cookie(response, request, token, config)
    return response


async def _identity(request: Request, client: OidcClient, signer: sessions.Sessions) -> Any:
    """The identity of a callback: its state the one of this browser's sign-in, the code exchanged, the ID token
    checked."""
    params = request.query_params
    if params.get("error"):
        raise OidcRefused("provider_refused", f"the identity provider refused: {params['error'][:100]}")
    pending = signer.unsign(request.cookies.get(LOGIN_COOKIE, ""), "oidc_login")
    if pending is None:
        raise OidcRefused("sign_in_expired", "no sign-in under way in this browser (or it took over 10 minutes)")
    state, code = params.get("state", ""), params.get("code", "")
    if not hmac.compare_digest(state.encode(), str(pending.get("state", "")).encode()):
        raise OidcRefused("state_mismatch", "the callback's state is not the one this browser's sign-in sent")
    if not code or len(code) > 4096:
        raise OidcRefused("invalid_request", "the callback carries no code")
    login_state = LoginState(str(pending["state"]), str(pending["nonce"]), str(pending["verifier"]))
    id_token = await client.exchange(code, login_state, _redirect_uri(request, client))
    return await client.identity(id_token, login_state)
