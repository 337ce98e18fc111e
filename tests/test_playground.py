"""The playground page in a real headless Chromium (Debian ``chromium`` + ``chromium-driver``, driven by
selenium): type the key, fill the form, submit, read the bars — they equal the API's own answer."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest
from servers import start_decisiond
from services import start_chromium

MASTER = "playground-master-key-0123456789"
DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.fixture(scope="module")
def keyed_server(tiny_dir, tmp_path_factory):
    database = tmp_path_factory.mktemp("keys") / "keys.db"  # its own key store: not the user's default file
    running = start_decisiond("--model", tiny_dir, "--served-model-name", "tiny-play",
                              env={"DECISIOND_MASTER_KEY": MASTER, "DECISIOND_DATABASE_URL": f"sqlite:///{database}"})
    yield running
    running.stop()


@pytest.fixture()
def browser():
    driver = start_chromium("--window-size=1400,1500")
    yield driver
    driver.quit()


def test_page_is_served_offline(keyed_server):
    page = httpx.get(keyed_server.url + "/")
    assert page.status_code == 200 and "decisiond playground" in page.text
    assert "http" not in page.text.replace("http-equiv", "")  # no CDN: every asset is local
    assert httpx.get(keyed_server.url + "/playground").text == page.text
    for name in ("playground.js", "playground.css"):
        assert httpx.get(keyed_server.url + "/static/" + name).status_code == 200
    assert httpx.get(keyed_server.url + "/static/../server.py").status_code == 404


def test_form_to_bars_in_chromium(keyed_server, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.select import Select
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 60)
    browser.get(keyed_server.url + "/playground")
    browser.find_element(By.ID, "key").send_keys(MASTER)
    browser.find_element(By.ID, "load-models").click()
    wait.until(lambda d: d.find_element(By.ID, "model").get_attribute("data-loaded") == "true")
    Select(browser.find_element(By.ID, "model")).select_by_value("tiny-play")
    Select(browser.find_element(By.ID, "order")).select_by_value("cyclic")
    text = browser.find_element(By.ID, "input")
    text.clear()
    text.send_keys("My parcel arrived broken and nobody answers my emails.")
    browser.find_element(By.ID, "add-predicate").click()
    last = browser.find_elements(By.CSS_SELECTOR, "#questions .question")[-1]
    name = last.find_element(By.CLASS_NAME, "q-name")
    name.clear()
    name.send_keys("angry")
    instructions = last.find_element(By.CLASS_NAME, "q-instructions")
    instructions.clear()
    instructions.send_keys("Is the customer angry?")
    browser.find_element(By.ID, "submit").click()
    wait.until(ec.presence_of_all_elements_located((By.CSS_SELECTOR, "#answers .answer")))

    cards = browser.find_elements(By.CSS_SELECTOR, "#answers .answer")
    shown = {c.get_attribute("data-name"): [(r.get_attribute("data-label"), float(r.get_attribute("data-probability")))
                                            for r in c.find_elements(By.CLASS_NAME, "bar-row")] for c in cards}
    assert list(shown) == ["billing", "team", "urgency", "angry"]
    status = browser.find_element(By.ID, "status")
    assert int(status.get_attribute("data-tokens")) > 0 and float(status.get_attribute("data-latency-ms")) > 0
    widths = [b.get_attribute("style") for b in cards[1].find_elements(By.CLASS_NAME, "fill")]
    assert all("width" in w for w in widths)

    questions = [
        {"type": "predicate", "name": "billing", "instructions": "Is this ticket about billing?"},
        {"type": "choice", "name": "team", "instructions": "Which team should handle it?",
         "choices": [{"value": "billing"}, {"value": "shipping"}, {"value": "technical"}]},
        {"type": "score", "name": "urgency", "instructions": "How urgent is it?",
         "levels": [{"label": "Can wait"}, {"label": "This week"}, {"label": "Today"}]},
        {"type": "predicate", "name": "angry", "instructions": "Is the customer angry?"},
    ]
    api = httpx.post(keyed_server.url + "/v1/decisions", headers={"authorization": f"Bearer {MASTER}"}, json={
        "model": "tiny-play", "order": "cyclic", "input": "My parcel arrived broken and nobody answers my emails.",
        "questions": questions}).json()
    for answer in api["answers"]:
        bars = shown[answer["name"]]
        if answer["type"] == "predicate":
            assert bars == [("yes", pytest.approx(answer["probability"])), ("no", pytest.approx(1 - answer["probability"]))]
        else:
            key = "value" if answer["type"] == "choice" else "label"
            assert bars == [(str(p[key]), pytest.approx(p["probability"])) for p in answer["probabilities"]]
        card = next(c for c in cards if c.get_attribute("data-name") == answer["name"])
        assert float(card.get_attribute("data-label-mass")) == pytest.approx(answer["label_mass"])

    shot = tmp_path / "playground.png"
    browser.execute_script("window.scrollTo(0, 0)")
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    if os.environ.get("DECISIOND_UPDATE_SCREENSHOT"):
        DOCS.mkdir(exist_ok=True)
        shutil.copy(shot, DOCS / "playground.png")


def test_a_wrong_key_shows_the_error(keyed_server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(keyed_server.url + "/")
    browser.find_element(By.ID, "key").send_keys("wrong")
    browser.find_element(By.ID, "submit").click()
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "error").is_displayed())
    assert "401" in browser.find_element(By.ID, "error").text
