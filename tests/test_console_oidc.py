"""Single sign-on to the console against a small real identity provider on loopback (``oidc_provider``): its
discovery document, its JWKS, the authorization code flow with PKCE, RS256-signed ID tokens. An ID token that has
expired, is for another audience, from another issuer, badly signed or for another sign-in is refused; the role
claim maps to admin or read-only, and a read-only session can never change anything, whatever it sends."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
import upstreams
from oidc_provider import CLIENT_ID, CLIENT_SECRET, Provider
from servers import start_decisiond

MASTER = "console-oidc-master-key-0123456789"
ADMIN = {"Authorization": f"Bearer {MASTER}"}

CONFIG = """
auth: {master_key: "${TEST_MASTER}"}
database_url: "sqlite:///${DB_DIR}/console.sqlite3"
providers:
  - {name: up, type: openai, base_url: "${UP}/v1"}
models:
  - {name: luna, provider: up, upstream: gpt-6-luna}
console:
  sign_in_failures_per_minute: 20  # the refusals below fail about ten sign-ins; the last test reaches the bound
  oidc:
    issuer: "${ISSUER}"
    client_id: decisiond-console
    client_secret: "${OIDC_SECRET}"
    role_claim: groups
    admin_values: [decisiond-admins]
    read_only_values: [decisiond-viewers]
"""


@pytest.fixture(scope="module")
def idp():
    provider = Provider().start()
    yield provider
    provider.stop()


@pytest.fixture(scope="module")
def gateway(idp, tmp_path_factory):
    folder = tmp_path_factory.mktemp("console-oidc")
    config = folder / "gateway.yaml"
    config.write_text(CONFIG)
    up = upstreams.openai_server()
    server = start_decisiond("--config", str(config), env={
        "TEST_MASTER": MASTER, "DB_DIR": str(folder), "UP": up.url, "ISSUER": idp.issuer,
        "OIDC_SECRET": CLIENT_SECRET})
    idp.redirect_uris.add(server.url + "/console/oidc/callback")
    yield server
    server.stop()
    up.stop()


@pytest.fixture(autouse=True)
def honest_provider(idp):
    idp.tamper = None
    idp.user = {"sub": "u-1", "email": "ada@example.com", "groups": ["decisiond-admins"]}
    yield


def sign_in(gateway, idp) -> tuple[httpx.Client, httpx.Response]:
    """The browser's round trip: /console/oidc/start → the provider's authorize endpoint → the callback. The client
    (its cookies) and the callback's answer."""
    browser = httpx.Client(base_url=gateway.url, follow_redirects=False, timeout=30)
    start = browser.get("/console/oidc/start")
    assert start.status_code == 302, start.text
    authorize = httpx.get(start.headers["location"], follow_redirects=False)
    assert authorize.status_code == 302, authorize.text
    back = urlsplit(authorize.headers["location"])
    assert back.path == "/console/oidc/callback"
    return browser, browser.get(back.path + "?" + back.query)


def refusal(answer: httpx.Response) -> str | None:
    assert answer.status_code == 303, answer.text
    return parse_qs(urlsplit(answer.headers["location"]).query).get("sign_in_error", [None])[0]


def test_pkce_sign_in_makes_an_admin_session_that_holds_no_token(gateway, idp):
    browser = httpx.Client(base_url=gateway.url, follow_redirects=False)
    start = browser.get("/console/oidc/start")
    query = parse_qs(urlsplit(start.headers["location"]).query)
    assert start.headers["location"].startswith(idp.issuer + "/authorize?")
    assert {k: v[0] for k, v in query.items() if k in ("response_type", "client_id", "code_challenge_method")} == {
        "response_type": "code", "client_id": CLIENT_ID, "code_challenge_method": "S256"}
    assert "openid" in query["scope"][0].split() and query["nonce"][0] and query["state"][0]
    login_cookie = start.headers["set-cookie"].lower()
    assert "httponly" in login_cookie and "samesite=lax" in login_cookie and "path=/console/oidc" in login_cookie

    browser, callback = sign_in(gateway, idp)
    assert callback.status_code == 303 and callback.headers["location"] == "/console"
    cookie = callback.headers.get_list("set-cookie")
    session_cookie = next(c for c in cookie if c.startswith("decisiond_console="))
    assert "httponly" in session_cookie.lower() and "samesite=strict" in session_cookie.lower()
    assert "secure" not in session_cookie.lower()  # plain http on loopback; over https it is Secure
    # The token endpoint was called with the verifier whose S256 challenge the provider checked.
    assert idp.token_requests[-1]["code_verifier"] and idp.token_requests[-1]["grant_type"] == "authorization_code"
    assert "client_secret" not in idp.token_requests[-1]  # sent as HTTP Basic, as the provider asks

    session = browser.get("/console/session").json()
    assert (session["signed_in"], session["subject"], session["role"], session["via"]) == (
        True, "ada@example.com", "admin", "oidc")
    assert CLIENT_SECRET not in browser.cookies["decisiond_console"]
    # The session cookie carries no ID token, no access token, no secret: a few claims and a signature.
    assert len(browser.cookies["decisiond_console"]) < 400
    created = browser.post("/admin/keys", json={"name": "by-sso"}, headers={"x-csrf-token": session["csrf_token"]})
    assert created.status_code == 201, created.text
    assert created.json()["key"].startswith("dk-")
    log = gateway.log()
    assert CLIENT_SECRET not in log and created.json()["key"] not in log
    assert '"console_user": "ada@example.com"' in log or "ada@example.com" in log


@pytest.mark.parametrize("tamper, code", [("expired", "token_expired"), ("audience", "wrong_audience"),
                                          ("issuer", "wrong_issuer"), ("signature", "bad_signature"),
                                          ("nonce", "nonce_mismatch")])
def test_a_bad_id_token_is_refused(gateway, idp, tamper, code):
    idp.tamper = tamper
    browser, callback = sign_in(gateway, idp)
    assert refusal(callback) == code
    assert "decisiond_console" not in browser.cookies
    assert browser.get("/console/session").json()["signed_in"] is False


def test_the_role_claim_maps_to_admin_read_only_or_nothing(gateway, idp):
    idp.user = {"sub": "u-2", "email": "bob@example.com", "groups": ["others"]}
    _, callback = sign_in(gateway, idp)
    assert refusal(callback) == "no_role"
    idp.user = {"sub": "u-3", "email": "viewer@example.com", "groups": "decisiond-viewers"}
    browser, callback = sign_in(gateway, idp)
    assert refusal(callback) is None
    session = browser.get("/console/session").json()
    assert (session["role"], session["subject"]) == ("read_only", "viewer@example.com")


def test_a_read_only_session_can_read_but_never_write(gateway, idp):
    key = httpx.post(gateway.url + "/admin/keys", headers=ADMIN, json={"name": "kept"}).json()
    idp.user = {"sub": "u-3", "email": "viewer@example.com", "groups": ["decisiond-viewers"]}
    browser, _ = sign_in(gateway, idp)
    csrf = {"x-csrf-token": browser.get("/console/session").json()["csrf_token"]}
    for path in ("/admin/keys", "/admin/budgets", "/admin/audit", "/admin/usage/series", "/admin/batches"):
        assert browser.get(path).status_code == 200, path
    writes = [("POST", "/admin/keys", {"name": "x"}), ("DELETE", f"/admin/keys/{key['id']}", None),
              ("PUT", "/admin/budgets", {"key": key["id"], "limit_usd": 0, "period": "daily"}),
              ("DELETE", "/admin/budgets/x", None), ("PUT", "/admin/profiles/x", {"active": False}),
              ("POST", "/admin/learn", {"model": "luna"}), ("DELETE", "/admin/cache", None),
              ("POST", "/admin/batches/x/cancel", None)]
    for method, path, body in writes:
        answer = browser.request(method, path, json=body, headers=csrf)
        assert answer.status_code == 403 and answer.json()["error"]["code"] == "read_only_session", (path, answer.text)
    assert httpx.get(gateway.url + "/admin/keys", headers=ADMIN).json()["data"][-1]["status"] == "active"


def test_a_callback_that_is_not_this_browsers_sign_in_is_refused(gateway, idp):
    browser = httpx.Client(base_url=gateway.url, follow_redirects=False)
    start = browser.get("/console/oidc/start")
    back = urlsplit(httpx.get(start.headers["location"]).headers["location"])
    stranger = httpx.Client(base_url=gateway.url, follow_redirects=False)  # no sign-in cookie: a forged link
    assert refusal(stranger.get(back.path + "?" + back.query)) == "sign_in_expired"
    code = parse_qs(back.query)["code"][0]
    assert refusal(browser.get(f"{back.path}?code={code}&state=another-state")) == "state_mismatch"
    other = httpx.Client(base_url=gateway.url, follow_redirects=False)
    other.get("/console/oidc/start")  # another sign-in in another browser: its own state and verifier
    assert refusal(other.get(back.path + "?" + back.query)) == "state_mismatch"
    assert refusal(browser.get(back.path + "?error=access_denied")) == "provider_refused"


def test_sign_in_attempts_are_bounded(gateway, idp):
    """The last sign-in against this file's server: it leaves 127.0.0.1 refused for a minute. Wrong master keys
    until 429; then the right key and single sign-on are refused too, with Retry-After."""
    for attempt in range(21):
        answer = httpx.post(gateway.url + "/console/login", json={"master_key": f"guess-{attempt}"})
        if answer.status_code == 429:
            break
        assert answer.status_code == 401
    assert answer.status_code == 429 and answer.json()["error"]["code"] == "sign_in_limited", answer.text
    assert attempt >= 5  # the earlier refusals of this file counted; fewer than 20 here
    right = httpx.post(gateway.url + "/console/login", json={"master_key": MASTER})
    assert right.status_code == 429 and 1 <= int(right.headers["retry-after"]) <= 60
    assert httpx.get(gateway.url + "/console/oidc/start").status_code == 429
    assert httpx.get(gateway.url + "/admin/keys", headers=ADMIN).status_code == 200  # the bearer API is not bounded


# ---------------------------------------------------------------------------------------------- in process


def test_session_tokens_are_for_one_use_and_expire():
    from decisiond.gateway.console_settings import ConsoleConfig
    from decisiond.server.console_session import Sessions

    now = [1_000_000.0]
    sessions = Sessions(b"s" * 32, 600, oidc=False, clock=lambda: now[0])
    token, session = sessions.issue("master", "admin", "master_key")
    assert sessions.read(token) == session and "s" * 32 not in token
    assert sessions.unsign(token, "oidc_login") is None  # a session is not a sign-in's state, nor the reverse
    assert sessions.read(sessions.sign({"sid": "x", "sub": "a", "role": "admin", "via": "oidc"}, "oidc_login", 60)) \
        is None
    assert Sessions(b"t" * 32, 600, oidc=False, clock=lambda: now[0]).read(token) is None  # another secret
    _, oidc = sessions.issue("ada", "read_only", "oidc")
    assert sessions.read(sessions.sign({"sid": "y", "sub": "ada", "role": "read_only", "via": "oidc"}, "session",
                                       60)) is None  # single sign-on no longer configured
    now[0] += 601
    assert sessions.read(token) is None
    assert Sessions.of(ConsoleConfig(), None) is None  # no master key, no secret: no session can be signed
    assert session.csrf != oidc.csrf and len(session.csrf) == 40


def test_the_session_cookie_is_secure_over_https():
    from fastapi.testclient import TestClient

    from decisiond.gateway.config import parse
    from decisiond.gateway.router import Router
    from decisiond.gateway.service import Gateway
    from decisiond.server.app import create_app

    config = parse({"auth": {"master_key": MASTER}, "providers": [
        {"name": "up", "type": "openai", "base_url": "http://127.0.0.1:9/v1"}]})
    app = create_app(Router.from_config(config, {}), gateway=Gateway(Router.from_config(config, {}), config))
    for base, secure in (("https://console.example", True), ("http://127.0.0.1", False)):
        signed = TestClient(app, base_url=base).post("/console/login", json={"master_key": MASTER})
        assert signed.status_code == 200, signed.text
        assert ("; secure" in signed.headers["set-cookie"].lower()) is secure, signed.headers["set-cookie"]


def test_the_role_claim_is_read_as_configured():
    from decisiond.gateway.console_settings import OidcConfig
    from decisiond.server.console_oidc import challenge, role_of

    config = OidcConfig(issuer="https://idp.example", client_id="c", role_claim="realm_access.roles",
                        admin_values=["ops"], read_only_values=["audit"])
    assert role_of(config, {"realm_access": {"roles": ["x", "ops"]}}) == "admin"
    assert role_of(config, {"realm_access": {"roles": "audit"}}) == "read_only"
    assert role_of(config, {"realm_access": {"roles": ["ops-not"]}, "groups": ["ops"]}) is None
    assert role_of(config.model_copy(update={"default_role": "read_only"}), {}) == "read_only"
    # S256, base64url without padding (the provider of these tests checks it independently at its token endpoint)
    assert len(challenge("v" * 43)) == 43 and "=" not in challenge("v" * 43) and challenge("a") != challenge("b")
    for bad in ({"issuer": "http://idp.example"}, {"algorithms": ["HS256"]}, {"admin_values": []},
                {"redirect_uri": "https://x.example/elsewhere"}):
        with pytest.raises(ValueError):
            OidcConfig(**{"issuer": "https://idp.example", "client_id": "c", "admin_values": ["ops"], **bad})


def test_the_console_can_be_turned_off_and_single_sign_on_needs_a_signing_secret(monkeypatch):
    from fastapi.testclient import TestClient

    from decisiond.gateway.config import ConfigError, parse
    from decisiond.gateway.router import Router
    from decisiond.gateway.service import Gateway
    from decisiond.server.app import create_app

    provider = {"name": "up", "type": "openai", "base_url": "http://127.0.0.1:9/v1"}
    config = parse({"auth": {"master_key": MASTER}, "console": {"enabled": False}, "providers": [provider]})
    client = TestClient(create_app(Router.from_config(config, {}), gateway=Gateway(Router.from_config(config, {}),
                                                                                   config)))
    for method, path in (("GET", "/console"), ("GET", "/console/session"), ("POST", "/console/login"),
                         ("GET", "/console/oidc/start")):
        assert client.request(method, path, json={"master_key": MASTER}).status_code == 404, path
    assert client.get("/admin/keys", headers=ADMIN).status_code != 404  # the admin API stays
    monkeypatch.delenv("DECISIOND_MASTER_KEY", raising=False)
    keyless = parse({"console": {"oidc": {"issuer": "https://idp.example", "client_id": "c",
                                          "admin_values": ["ops"]}}, "providers": [provider]})
    with pytest.raises(ConfigError, match="session_secret"):
        Gateway(Router.from_config(keyless, {}), keyless)


@pytest.mark.parametrize("database", ["sqlite", "postgresql"], indirect=True)
def test_usage_series_buckets_by_utc_minute_hour_and_day_on_both_databases(database):
    import asyncio
    from datetime import datetime, timezone

    from decisiond.gateway import usage
    from decisiond.store.db import Database
    from decisiond.store.tables import UsageRow

    times = [datetime(2026, 3, 1, 10, 15, 5, tzinfo=timezone.utc), datetime(2026, 3, 1, 10, 15, 50, tzinfo=timezone.utc),
             datetime(2026, 3, 1, 11, 2, 0, tzinfo=timezone.utc), datetime(2026, 3, 2, 0, 0, 1, tzinfo=timezone.utc)]

    async def main():
        db = await Database.open(database)
        try:
            async with db.session() as session, session.begin():
                for n, moment in enumerate(times):
                    session.add(UsageRow(time=moment, day=moment.strftime("%Y-%m-%d"), request_id=f"r{n}",
                                         key_id="k1", user_path="/", request_type="decisions", model="m",
                                         input_tokens=10, output_tokens=1, cost=0.5, status=200, latency_ms=1.0))
            where = usage.UsageFilter(start=datetime(2026, 3, 1, tzinfo=timezone.utc))
            return {b: [(r["bucket"], r["requests"], r["cost_usd"]) for r in await usage.series(db, b, ["key"], where,
                                                                                                 100)]
                    for b in ("minute", "hour", "day")}
        finally:
            await db.aclose()

    found = asyncio.run(main())
    assert found["minute"] == [("2026-03-01T10:15:00Z", 2, 1.0), ("2026-03-01T11:02:00Z", 1, 0.5),
                               ("2026-03-02T00:00:00Z", 1, 0.5)]
    assert found["hour"] == [("2026-03-01T10:00:00Z", 2, 1.0), ("2026-03-01T11:00:00Z", 1, 0.5),
                             ("2026-03-02T00:00:00Z", 1, 0.5)]
    assert found["day"] == [("2026-03-01T00:00:00Z", 3, 1.5), ("2026-03-02T00:00:00Z", 1, 0.5)]
