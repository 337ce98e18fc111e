"""The operator's console (``/console``) in a real headless Chromium (selenium), on a real decisiond: sign in with
the master key, create a key (its secret shown once, then gone from the page), send it requests and watch its spend
move, stop its budget (limit 0) and see its requests refused, roll a learned profile back, then sign in again with
single sign-on as a read-only operator, across sites (the identity provider on ``localhost``, the console on
``127.0.0.1``). No JavaScript error, no CSP violation. Screenshots for the docs (``DECISIOND_UPDATE_SCREENSHOT=1``).

Without a browser: the session's rules (CSRF, origin, sign-out, cookies) and the bearer admin API unchanged."""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

import httpx
import pytest
import torch
from conftest import tiny_loaded
from oidc_provider import CLIENT_SECRET, Provider
from servers import start_decisiond
from services import start_chromium

MASTER = "console-master-key-0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {MASTER}"}
DOCS = Path(__file__).resolve().parents[1] / "docs"
TEAMS = ["payments", "mobile", "sales"]
TEAM = {"type": "choice", "name": "team", "instructions": "Which team should take it?",
        "choices": [{"value": t} for t in TEAMS]}
WORDS = {"payments": ["invoice", "refund", "charged twice", "billing address", "credit card"],
         "mobile": ["app crashes", "login screen", "push notifications", "android update", "iphone battery"],
         "sales": ["pricing plans", "a demo", "enterprise quote", "discount", "a reseller"]}
OPENERS = ["Hello, I have a question about", "Please help with", "Urgent:", "We need to talk about"]
TICKETS = {f"{o} {w}.": team for team, ws in WORDS.items() for w in ws for o in OPENERS}

CONFIG = """
auth: {master_key: "${TEST_MASTER}"}
database_url: "sqlite:///${DB_DIR}/console.sqlite3"
cache: {enabled: false}
providers:
  - {name: local, type: local, model: "${FLAT_DIR}", served_model_name: tiny-flat}
models:
  - {name: flat, provider: local, store: true, pricing: {per_request: 0.01}}
console:
  oidc: {issuer: "${ISSUER}", client_id: decisiond-console, client_secret: "${OIDC_SECRET}",
         admin_values: [decisiond-admins], read_only_values: [decisiond-viewers]}
"""

# Before any script of the page: every error, unhandled rejection and CSP violation is kept in window.__errors.
ERROR_TRAP = """window.__errors = [];
addEventListener('error', (e) => window.__errors.push('error: ' + e.message));
addEventListener('unhandledrejection', (e) => window.__errors.push('rejection: ' + e.reason));
document.addEventListener('securitypolicyviolation', (e) => window.__errors.push('csp: ' + e.violatedDirective));"""


@pytest.fixture(scope="module")
def flat_dir(tokenizer, tmp_path_factory) -> str:
    """The tiny random model, its answers near uniform (it knows nothing) while its hidden states tell the tickets
    apart: a learned head helps it, and is accepted."""
    folder = tmp_path_factory.mktemp("console-flat")
    loaded = tiny_loaded(tokenizer)
    with torch.no_grad():
        loaded.model.model.norm.weight.div_(40.0)
    loaded.model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def idp():
    provider = Provider(host="localhost").start()
    provider.user = {"sub": "u-9", "email": "viewer@example.com", "groups": ["decisiond-viewers"]}
    yield provider
    provider.stop()


@pytest.fixture(scope="module")
def gateway(flat_dir, idp, tmp_path_factory):
    folder = tmp_path_factory.mktemp("console")
    config = folder / "gateway.yaml"
    config.write_text(CONFIG)
    server = start_decisiond("--config", str(config), env={
        "TEST_MASTER": MASTER, "DB_DIR": str(folder), "FLAT_DIR": flat_dir, "ISSUER": idp.issuer,
        "OIDC_SECRET": CLIENT_SECRET})
    idp.redirect_uris.add(server.url + "/console/oidc/callback")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser(gateway):
    driver = start_chromium("--window-size=1400,2000")
    driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": ERROR_TRAP})
    yield driver
    driver.quit()


def ask(gateway, key: str, text: str) -> httpx.Response:
    return httpx.post(gateway.url + "/v1/decisions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": "flat", "input": text, "questions": [TEAM]})


def learned_profile(gateway) -> str:
    """60 tickets asked, labelled by the operator and learned from: the head accepted for everyone (scope /)."""
    texts = sorted(TICKETS, key=lambda t: random.Random(t).random())[:60]
    ids = [ask(gateway, MASTER, text).headers["x-request-id"] for text in texts]
    deadline = time.monotonic() + 60
    while httpx.get(gateway.url + "/admin/quality", headers=ADMIN, params={"model": "flat"}).json()["decisions"] < 60:
        assert time.monotonic() < deadline, "the decisions were not written"
        time.sleep(0.2)
    for request_id, text in zip(ids, texts):
        posted = httpx.post(f"{gateway.url}/v1/decisions/{request_id}/labels", headers=ADMIN,
                            json={"labels": {"team": TICKETS[text]}})
        assert posted.status_code == 200, posted.text
    learned = httpx.post(gateway.url + "/admin/learn", headers=ADMIN, json={"model": "flat"}, timeout=120).json()
    (question,) = [q for q in learned["questions"] if q["scope"] == "/"]
    assert question["accepted"] == "head", question
    return question["profile"]


def shot(browser, name: str, tmp_path) -> None:
    path = tmp_path / name
    browser.save_screenshot(str(path))
    assert path.stat().st_size > 10_000
    if os.environ.get("DECISIOND_UPDATE_SCREENSHOT"):
        shutil.copy(path, DOCS / name)


def no_errors(browser) -> None:
    assert browser.execute_script("return window.__errors") == []
    assert not browser.find_element("id", "notice").get_attribute("data-kind") == "error", \
        browser.find_element("id", "notice").text


def wait_for(browser, predicate, timeout: float = 30):
    """Until ``predicate()`` is true; an element it read that the page drew again meanwhile (the console redraws a
    table as its data comes) is read again at the next poll."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, timeout, poll_frequency=0.1, ignored_exceptions=(
        NoSuchElementException, StaleElementReferenceException)).until(lambda d: predicate())


def click(browser, css: str) -> None:
    """Click the element ``css`` finds, found again where the page redrew it between the find and the click."""
    wait_for(browser, lambda: find(browser, css).click() or True)


def find(browser, css: str):
    from selenium.webdriver.common.by import By

    return browser.find_element(By.CSS_SELECTOR, css)


def finds(browser, css: str):
    from selenium.webdriver.common.by import By

    return browser.find_elements(By.CSS_SELECTOR, css)


def refreshed(browser, check, timeout: float = 30) -> None:
    """Click Refresh until ``check()`` holds (usage rows are written off the request path)."""
    deadline = time.monotonic() + timeout
    while True:
        before = find(browser, "body").get_attribute("data-refreshed")
        find(browser, "#refresh").click()
        wait_for(browser, lambda: find(browser, "body").get_attribute("data-refreshed") != before)
        if _holds(check):
            return
        assert time.monotonic() < deadline, "the console never showed it"
        time.sleep(0.3)


def _holds(check) -> bool:
    """``check()``, false where an element it read was drawn again as it read it."""
    from selenium.common.exceptions import StaleElementReferenceException

    try:
        return bool(check())
    except StaleElementReferenceException:
        return False


def sign_in_with_master_key(browser, gateway) -> None:
    """Open the console signed in with the master key (signed out first, from an earlier test's session)."""
    browser.get(gateway.url + "/console")
    wait_for(browser, lambda: find(browser, "#sign-in").is_displayed() or find(browser, "#app").is_displayed())
    if find(browser, "#app").is_displayed():
        find(browser, "#sign-out").click()
        wait_for(browser, lambda: find(browser, "#sign-in").is_displayed())
    find(browser, "input[name=master_key]").send_keys(MASTER)
    find(browser, "#login button[type=submit]").click()
    wait_for(browser, lambda: find(browser, "#app").is_displayed() and find(browser, "body").get_attribute(
        "data-refreshed"))


def create_key(browser, name: str) -> tuple[str, str]:
    """Create a key in the form: its id and its secret, read from the box that shows it once, then closed."""
    find(browser, "#key-name").send_keys(name)
    find(browser, "#key-rpm").send_keys("600")
    find(browser, "#key-create").click()
    wait_for(browser, lambda: find(browser, "#new-key").is_displayed())
    secret, key_id = find(browser, "#new-key-secret").text, find(browser, "#new-key").get_attribute("data-id")
    assert secret.startswith("dk-") and secret in browser.page_source
    wait_for(browser, lambda: finds(browser, f'#key-table tr[data-id="{key_id}"]'))
    find(browser, "#new-key-done").click()
    # dk-<id>-<random>: the random part is URL-safe base64 and may itself hold a "-" (then its last piece was one
    # letter, found in the page's own words: a failed run read "Q" in "Quality")
    assert secret not in browser.page_source and secret.split("-", 2)[2] not in browser.page_source
    return key_id, secret


def test_an_operator_runs_the_gateway_from_the_console(gateway, browser, tmp_path):
    profile = learned_profile(gateway)
    sign_in_with_master_key(browser, gateway)
    assert MASTER not in browser.page_source  # the field was emptied; nothing kept it
    assert find(browser, "#who-role").text == "admin"
    key_id, secret = create_key(browser, "ci-bot")

    # A budget on the key, set in the console; the key's requests move its spend and its usage.
    find(browser, "#budget-of").send_keys(key_id)
    find(browser, "#budget-limit").send_keys("1")
    find(browser, "#budget-form button[type=submit]").click()
    budget = f'.budget[data-scope="{key_id}"]'
    wait_for(browser, lambda: finds(browser, budget))
    assert float(find(browser, budget).get_attribute("data-spent")) == 0
    for text in list(TICKETS)[:3]:
        assert ask(gateway, secret, text).status_code == 200
    refreshed(browser, lambda: float(find(browser, budget).get_attribute("data-spent")) == pytest.approx(0.03))
    refreshed(browser, lambda: bool(finds(browser, f'#usage-table tr[data-group="{key_id}"]')))
    row = find(browser, f'#usage-table tr[data-group="{key_id}"]')
    assert (row.get_attribute("data-requests"), float(row.get_attribute("data-cost"))) == ("3", pytest.approx(0.03))
    assert finds(browser, "#chart-cost canvas") and finds(browser, "#chart-requests .u-legend")
    assert finds(browser, '#audit-table tr td:nth-child(2)') and key_id in find(browser, "#audit-table").text
    browser.execute_script("document.getElementById('budgets').scrollIntoView()")
    shot(browser, "console-budgets.png", tmp_path)

    # The kill switch: the budget's limit to 0, and the key's next request is refused.
    click(browser, f"{budget} button.stop")
    wait_for(browser, lambda: find(browser, budget).get_attribute("data-limit") == "0")
    refused = ask(gateway, secret, list(TICKETS)[4])
    assert refused.status_code == 402 and refused.json()["error"]["code"] == "budget_exceeded", refused.text

    # Quality: the learned profile is active; rolled back from the console, it serves no more.
    wait_for(browser, lambda: finds(browser, f'#profile-table tr[data-profile="{profile}"]'))
    assert int(find(browser, "#chart-reliability").get_attribute("data-bins")) > 0
    assert finds(browser, "#chart-quality canvas") and finds(browser, "#chart-reliability canvas")
    browser.execute_script("document.getElementById('quality').scrollIntoView()")
    shot(browser, "console-quality.png", tmp_path)
    assert ask(gateway, MASTER, list(TICKETS)[5]).headers.get("x-decisiond-profile") == profile
    click(browser, f'#profile-table tr[data-profile="{profile}"] button.rollback')
    browser.switch_to.alert.accept()
    wait_for(browser, lambda: not finds(browser, f'#profile-table tr[data-profile="{profile}"]'))
    listed = httpx.get(gateway.url + "/admin/profiles", headers=ADMIN, params={"model": "flat"}).json()["data"]
    assert [p["active"] for p in listed if p["id"] == profile] == [False]
    assert "x-decisiond-profile" not in ask(gateway, MASTER, list(TICKETS)[6]).headers

    browser.execute_script("window.scrollTo(0, 0)")
    shot(browser, "console.png", tmp_path)
    no_errors(browser)
    assert secret not in browser.page_source and MASTER not in browser.page_source


def test_a_batch_shows_its_progress_and_is_cancelled_from_the_console(gateway, browser, tmp_path):
    import json

    lines = "".join(json.dumps({"custom_id": f"t{i}", "method": "POST", "url": "/v1/decisions", "body": {
        "model": "flat", "input": text, "questions": [TEAM]}}) + "\n" for i, text in enumerate(list(TICKETS) * 40))
    uploaded = httpx.post(gateway.url + "/v1/files", headers=ADMIN, data={"purpose": "batch"},
                          files={"file": ("tickets.jsonl", lines.encode())})
    assert uploaded.status_code == 200, uploaded.text
    batch = httpx.post(gateway.url + "/v1/batches", headers=ADMIN, json={
        "input_file_id": uploaded.json()["id"], "endpoint": "/v1/decisions", "completion_window": "24h"}).json()
    sign_in_with_master_key(browser, gateway)
    row = f'#batch-table tr[data-id="{batch["id"]}"]'
    refreshed(browser, lambda: bool(finds(browser, row)) and "/ 2400" in find(browser, row).text)
    assert wait_for(browser, lambda: find(browser, row).get_attribute("data-status")) in ("validating", "in_progress")
    click(browser, f"{row} button.cancel")
    wait_for(browser, lambda: find(browser, row).get_attribute("data-status") in ("cancelling", "cancelled"))
    deadline = time.monotonic() + 60
    while httpx.get(f"{gateway.url}/v1/batches/{batch['id']}", headers=ADMIN).json()["status"] != "cancelled":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    refreshed(browser, lambda: find(browser, row).get_attribute("data-status") == "cancelled")
    assert not finds(browser, f"{row} button.cancel")
    done = httpx.get(f"{gateway.url}/v1/batches/{batch['id']}", headers=ADMIN).json()["request_counts"]
    assert done["completed"] < 2400
    no_errors(browser)


def test_single_sign_on_in_chromium_across_sites_signs_in_read_only(gateway, browser, idp, tmp_path):
    # A key with a budget of its own, whatever the other tests left: rows whose change buttons a viewer must not see.
    made = httpx.post(gateway.url + "/admin/keys", headers=ADMIN, json={"name": "seen-by-a-viewer"})
    assert made.status_code == 201, made.text
    budget = httpx.put(gateway.url + "/admin/budgets", headers=ADMIN,
                       json={"key": made.json()["id"], "limit_usd": 5, "period": "daily"})
    assert budget.status_code == 200, budget.text
    browser.get(gateway.url + "/console")
    wait_for(browser, lambda: find(browser, "#sign-in").is_displayed() or find(browser, "#app").is_displayed())
    if find(browser, "#app").is_displayed():
        find(browser, "#sign-out").click()
        wait_for(browser, lambda: find(browser, "#sign-in").is_displayed())
    assert find(browser, "#sso").is_displayed()
    find(browser, "#sso").click()  # to localhost (another site), and back with a code
    wait_for(browser, lambda: find(browser, "#app").is_displayed() and find(browser, "body").get_attribute(
        "data-refreshed"))
    assert browser.current_url == gateway.url + "/console"
    assert (find(browser, "#who-name").text, find(browser, "#who-role").text) == ("viewer@example.com", "read-only")
    # Every change is hidden (and refused by the server: tests/test_console_oidc.py); the buttons are there, unseen.
    changes = finds(browser, "button.revoke, button.stop, #key-create, #budget-form button")
    assert len(changes) >= 4 and not any(b.is_displayed() for b in changes)
    assert finds(browser, "#key-table tbody tr")  # it reads everything
    browser.execute_script("window.scrollTo(0, 0)")
    shot(browser, "console-read-only.png", tmp_path)
    no_errors(browser)
    find(browser, "#sign-out").click()
    wait_for(browser, lambda: find(browser, "#sign-in").is_displayed())
    assert browser.get_cookie("decisiond_console") is None


# ------------------------------------------------------------------------------------------ without a browser


def session_client(gateway) -> tuple[httpx.Client, str]:
    """A client signed in with the master key (JSON, as the page's script does) and its CSRF token."""
    client = httpx.Client(base_url=gateway.url, follow_redirects=False, timeout=30)
    signed = client.post("/console/login", json={"master_key": MASTER})
    assert signed.status_code == 200, signed.text
    cookie = signed.headers["set-cookie"].lower()
    assert all(flag in cookie for flag in ("httponly", "samesite=strict", "path=/")) and "secure" not in cookie
    assert MASTER not in signed.text and MASTER not in client.cookies["decisiond_console"]
    return client, signed.json()["csrf_token"]


def test_a_session_change_needs_its_csrf_token_from_its_own_origin(gateway):
    client, csrf = session_client(gateway)
    assert client.get("/admin/keys").status_code == 200  # a read needs no token
    for headers in ({}, {"x-csrf-token": "0" * 40}, {"x-csrf-token": csrf, "origin": "http://evil.example"},
                    {"x-csrf-token": csrf, "sec-fetch-site": "cross-site"}):
        refused = client.post("/admin/keys", json={"name": "x"}, headers=headers)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "csrf_failed", (headers, refused.text)
    made = client.post("/admin/keys", json={"name": "with-token"}, headers={
        "x-csrf-token": csrf, "origin": gateway.url, "sec-fetch-site": "same-origin"})
    assert made.status_code == 201, made.text
    bad = client.post("/admin/keys", json={"name": ""}, headers={"x-csrf-token": csrf})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "name"
    forged = client.cookies["decisiond_console"][:-4] + "AAAA"
    answer = httpx.get(gateway.url + "/admin/keys", cookies={"decisiond_console": forged})
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "console_session_required"


def test_signing_out_ends_the_session_even_for_a_copy_of_its_cookie(gateway):
    client, csrf = session_client(gateway)
    copy = client.cookies["decisiond_console"]
    assert client.post("/console/logout").status_code == 403  # no CSRF token: no forced sign-out either
    out = client.post("/console/logout", headers={"x-csrf-token": csrf})
    assert out.status_code == 200 and 'decisiond_console=""' in out.headers["set-cookie"]
    assert httpx.get(gateway.url + "/admin/keys", cookies={"decisiond_console": copy}).status_code == 401
    assert httpx.get(gateway.url + "/console/session", cookies={"decisiond_console": copy}).json()["signed_in"] \
        is False


def test_the_bearer_admin_api_is_unchanged(gateway):
    assert httpx.get(gateway.url + "/admin/keys", headers=ADMIN).status_code == 200
    key = httpx.post(gateway.url + "/admin/keys", headers=ADMIN, json={"name": "plain"}).json()
    by_key = httpx.get(gateway.url + "/admin/keys", headers={"Authorization": f"Bearer {key['key']}"})
    assert by_key.status_code == 403 and by_key.json()["error"]["code"] == "master_key_required"
    missing = httpx.get(gateway.url + "/admin/keys")
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    client, _ = session_client(gateway)
    # A bearer header is the bearer API, whatever cookie comes with it: a wrong key is refused.
    wrong = client.get("/admin/keys", headers={"Authorization": "Bearer wrong-key-0123456789"})
    assert wrong.status_code == 401
    listed = httpx.get(gateway.url + "/admin/keys", headers=ADMIN).text
    assert key["key"] not in listed and "dk-" in listed  # the prefix, never the secret


def test_the_master_key_form_and_its_refusals(gateway):
    form = httpx.post(gateway.url + "/console/login", data={"master_key": MASTER})
    assert form.status_code == 303 and form.headers["location"] == "/console" and "decisiond_console=" in \
        form.headers["set-cookie"]
    wrong = httpx.post(gateway.url + "/console/login", data={"master_key": "not-it"})
    assert wrong.status_code == 303 and wrong.headers["location"] == "/console?sign_in_error=invalid_master_key"
    assert "set-cookie" not in wrong.headers
    managed = httpx.post(gateway.url + "/admin/keys", headers=ADMIN, json={"name": "not-master"}).json()["key"]
    for body in ({"master_key": managed}, {}, {"master_key": 7}):
        refused = httpx.post(gateway.url + "/console/login", json=body)
        assert refused.status_code == 401 and refused.json()["error"]["param"] == "master_key", refused.text
    log = gateway.log()
    assert MASTER not in log and managed not in log and "not-it" not in log


def test_the_page_holds_no_data_and_a_strict_policy(gateway):
    page = httpx.get(gateway.url + "/console")
    assert page.status_code == 200 and 'name="master_key"' in page.text
    assert "http" not in page.text.replace("http-equiv", "")  # every asset is local
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy and "unsafe" not in policy
    assert page.headers["x-frame-options"] == "DENY" and page.headers["cache-control"] == "no-store"
    for name in ("console.js", "console.css", "uplot.iife.min.js", "uplot.min.css"):
        assert httpx.get(gateway.url + "/static/" + name).status_code == 200, name
    assert "uPlot" in httpx.get(gateway.url + "/static/uplot.iife.min.js").text[:100]


def test_the_new_admin_views_name_the_field_at_fault(gateway):
    for path, params, field in (("/admin/usage/series", {"bucket": "week"}, "bucket"),
                                ("/admin/usage/series", {"group_by": "colour"}, "group_by"),
                                ("/admin/usage/series", {"start": "yesterday"}, "start"),
                                ("/admin/quality/series", {"model": "nope"}, "model"),
                                ("/admin/quality/series", {"model": "flat", "bucket": "minute"}, "bucket"),
                                ("/admin/batches", {"limit": "0"}, "limit")):
        answer = httpx.get(gateway.url + path, headers=ADMIN, params=params)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == field, (path, answer.text)
    missing = httpx.post(gateway.url + "/admin/batches/batch_nope/cancel", headers=ADMIN)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "batch_id"


def test_usage_series_counts_each_request_in_its_minute(gateway):
    # A key of its own: what other tests of this server still write (a cancelled batch's last lines) is not counted.
    made = httpx.post(gateway.url + "/admin/keys", headers=ADMIN, json={"name": "series"})
    assert made.status_code == 201, made.text

    def flat_requests() -> tuple[int, float]:
        series = httpx.get(gateway.url + "/admin/usage/series", headers=ADMIN, params={
            "bucket": "minute", "group_by": "model,key"}).json()
        assert series["bucket_seconds"] == 60 and series["group_by"] == ["model", "key"]
        assert all(r["bucket"].endswith(":00Z") for r in series["data"])
        rows = [r for r in series["data"] if r["model"] == "flat" and r["key"] == made.json()["id"]]
        return sum(r["requests"] for r in rows), sum(r["cost_usd"] for r in rows)

    before = flat_requests()
    for text in list(TICKETS)[:2]:
        assert ask(gateway, made.json()["key"], text).status_code == 200
    deadline = time.monotonic() + 20
    while flat_requests()[0] < before[0] + 2:
        assert time.monotonic() < deadline, "the usage series never counted the requests"
        time.sleep(0.2)
    assert flat_requests() == (before[0] + 2, pytest.approx(before[1] + 0.02))
