"""Headless Chromium drives the annotation page end to end: log in, the keyboard shortcuts, a reason-less
submit refused by the server (the page shows why), a vote with a reason, and the export that contains it.
A screenshot of the annotation page goes to the test artifacts (``$POSTTRAIN_TEST_ARTIFACTS`` or ``artifacts/``).
"""

from __future__ import annotations

import json
import shutil

import pytest

from posttrain.serve.db import open_db
from posttrain.serve.export import export_feedback
from tests.serve.conftest import ARTIFACTS, edge_case, start_server

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--window-size=1300,1000",
]  # fmt: skip


@pytest.fixture
def browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not chromium or not driver_path:
        pytest.fail("chromium and chromedriver are needed: `make test` installs them (apt-get install chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def test_annotate_in_the_browser_end_to_end(browser, make_db_url, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as seen
    from selenium.webdriver.support.ui import WebDriverWait

    def wait_for(element_id: str):  # a submit returns before the next page has loaded
        return WebDriverWait(browser, 30).until(seen.presence_of_element_located((By.ID, element_id)))

    live = start_server(make_db_url("sqlite"), guideline=("2025-01", "Prefer the correct answer. Explain why."))
    try:
        live.client("ingest").post("/api/edge-cases", json=edge_case())
        browser.get(f"{live.url}/annotate")
        assert "Please log in" in browser.find_element(By.ID, "message").text  # no session: refused
        browser.get(f"{live.url}/login")
        browser.find_element(By.ID, "token").send_keys(live.tokens["annotator"])
        browser.find_element(By.ID, "login").click()
        wait_for("vote-form")
        assert browser.current_url.endswith("/annotate")
        left, right = (browser.find_element(By.ID, f"response-{side}").text for side in ("a", "b"))
        assert {left, right} == {"41", "42"}
        assert "Prefer the correct answer" in browser.find_element(By.ID, "guideline").text
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "feedback_annotate.png"))

        body = browser.find_element(By.TAG_NAME, "body")
        body.send_keys("2")  # keyboard shortcut: B
        assert browser.find_element(By.ID, "choice-right").is_selected()
        body.send_keys("a")  # and back to A
        assert browser.find_element(By.ID, "choice-left").is_selected()
        # The page asks for a reason itself (required); a client that skips that check meets the server's.
        assert browser.find_element(By.ID, "reason").get_attribute("required") is not None
        browser.execute_script("document.getElementById('reason').removeAttribute('required')")
        body.send_keys(Keys.CONTROL, Keys.ENTER)
        error = wait_for("error").text
        assert "reason is required" in error
        assert {browser.find_element(By.ID, f"response-{s}").text for s in ("a", "b")} == {"41", "42"}  # same pair

        side_of_42 = "left" if browser.find_element(By.ID, "response-a").text == "42" else "right"
        browser.find_element(By.ID, f"choice-{side_of_42}").click()
        reason = browser.find_element(By.ID, "reason")
        reason.send_keys("6 * 7 = 42; the other answer is off by one")
        reason.send_keys(Keys.CONTROL, Keys.ENTER)  # Ctrl+Enter submits from the textarea
        assert "Vote saved" in wait_for("saved").text
        assert browser.find_elements(By.ID, "no-task")
        browser.save_screenshot(str(ARTIFACTS / "feedback_annotate_done.png"))
    finally:
        live.stop()
    assert (ARTIFACTS / "feedback_annotate.png").stat().st_size > 10_000

    db = open_db(live.db_url)
    manifest = export_feedback(db, tmp_path / "export")
    db.close()
    assert manifest["vote_log"]["votes"] == 1  # the refused submit left no vote
    (record,) = [json.loads(line) for line in (tmp_path / "export" / "preferences.jsonl").read_text().splitlines()]
    assert (record["chosen"], record["rejected"]) == ("42", "41")
    assert record["rationale"] == "6 * 7 = 42; the other answer is off by one"
    assert record["annotators"] == ["annotator"] and record["lineage"]["guideline_versions"] == ["2025-01"]
