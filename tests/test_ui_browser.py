"""The dashboard in a real headless Chromium, against a real gateway driven by the official
SDK: the session list, the timeline chart, compactions, a rollback from its button, what a
tenant key shows, and who is refused. Polling is waited for (WebDriverWait), never timed.
A screenshot of each page goes to tests/artifacts/ (or $CTXGATE_ARTIFACTS)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from browser import artifact_path, wait
from clients import assert_error_shape
from servers import KEYS, Gateway, stop_all
from test_ui_api import ADMIN_KEY, compacting_turns, drive, get, launch_open, new_session, outward_address, \
    session_path, uigw  # noqa: F401 (uigw: the module's gateway fixture)
from upstream import ScriptedUpstream

def js(driver: Any, script: str, *args: Any) -> Any:
    return driver.execute_script(script, *args)


def open_with_key(driver: Any, gw: Gateway, key: str, fragment: str = "") -> None:
    """The page, its key asked for once in the form (then kept in sessionStorage)."""
    from selenium.webdriver.common.by import By

    driver.get(f"{gw.base}/ui{fragment}")
    form = wait(driver, lambda d: d.find_element(By.ID, "key-form").is_displayed(), "the key form")
    assert form
    driver.find_element(By.ID, "key-input").send_keys(key)
    driver.find_element(By.ID, "key-submit").click()
    wait(driver, lambda d: d.find_element(By.ID, "board").is_displayed(), "the board")


def row_present(session: str) -> Callable[[Any], bool]:
    return lambda d: bool(js(d, "return document.querySelector(`#sessions tr[data-session='${arguments[0]}']`)",
                             session))


def chart_points(driver: Any, chart: str, trace: int) -> int:
    return int(js(driver, "const c = document.getElementById(arguments[0]);"
                          "return c && c.data && c.data[arguments[1]] ? c.data[arguments[1]].x.length : -1",
                  chart, trace))


def screenshot(driver: Any, name: str) -> Path:
    """The whole page: the window is made as tall as the document first."""
    height = int(js(driver, "return document.documentElement.scrollHeight"))
    driver.set_window_size(1400, max(1000, height + 40))
    path = artifact_path(name)
    driver.save_screenshot(str(path))
    return path


def test_the_admin_sees_a_compacting_session_live_and_rolls_it_back(
        chromium: Any, uigw: Gateway, upstream: ScriptedUpstream) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions

    session = new_session()
    turns, tools = compacting_turns(8)
    levels = drive(uigw, session, turns[:6], tools)
    assert any(lv != "none" for lv in levels), levels

    open_with_key(chromium, uigw, ADMIN_KEY, f"#tenant=acme&session={session}")
    wait(chromium, row_present(session), "the session's row")
    wait(chromium, lambda d: chart_points(d, "timeline-chart", 0) == 6, "one timeline point per turn")
    assert chart_points(chromium, "timeline-chart", 1) == 6
    compacting = sum(1 for lv in levels if lv != "none")
    wait(chromium, lambda d: chart_points(d, "timeline-chart", 3) == compacting, "a marker per compacting turn")
    shown_levels = {e.get_attribute("data-level") for e in chromium.find_elements(By.CSS_SELECTOR, "#compactions tr")}
    assert shown_levels >= set(next(lv for lv in levels if lv != "none").split(","))
    wait(chromium, lambda d: chart_points(d, "metrics-chart", 0) == 60, "the last-hour chart")

    # A turn while the page is open: it shows up without a reload.
    more = drive(uigw, session, turns[6:8], tools)
    wait(chromium, lambda d: chart_points(d, "timeline-chart", 0) == 8, "the new turns on the chart")
    row = chromium.find_element(By.CSS_SELECTOR, f"#sessions tr[data-session='{session}']")
    wait(chromium, lambda d: row.get_attribute("data-answered") == "8", "the row's answered turns")
    assert chart_points(chromium, "timeline-chart", 3) == compacting + sum(1 for lv in more if lv != "none")
    screenshot(chromium, "dashboard-admin.png")

    target = min(c["seq"] for c in get(uigw, session_path("acme", session)).json()["checkpoints"]
                 if c["reason"] == "compaction")
    chromium.find_element(By.CSS_SELECTOR, f"#checkpoints button.rollback[data-seq='{target}']").click()
    wait(chromium, expected_conditions.alert_is_present(), "the confirmation")
    chromium.switch_to.alert.accept()
    wait(chromium, lambda d: f"rolled back to checkpoint {target}" in d.find_element(By.ID, "status").text,
         "the rollback's answer")
    summary = get(uigw, f"/v1/ctx/sessions/{session}", KEYS["acme"]).json()
    assert summary["compactions"][-1]["level"] == "rollback" and summary["compactions"][-1]["to_seq"] == target
    wait(chromium, lambda d: d.find_elements(By.CSS_SELECTOR, "#compactions tr[data-level='rollback']"),
         "the rollback in the compaction log")
    first_checkpoint = chromium.find_element(By.CSS_SELECTOR, "#checkpoints tbody tr")
    assert "rollback" in first_checkpoint.text and str(target) in first_checkpoint.text
    screenshot(chromium, "dashboard-rolled-back.png")


def test_a_tenant_key_sees_only_its_own_sessions(
        chromium: Any, uigw: Gateway, upstream: ScriptedUpstream) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By

    own, other = new_session(), new_session()
    turns, tools = compacting_turns(2)
    drive(uigw, own, turns, tools, key=KEYS["relay"])
    drive(uigw, other, turns, tools, key=KEYS["acme"])

    open_with_key(chromium, uigw, KEYS["relay"])
    wait(chromium, row_present(own), "the tenant's own session")
    tenants = {e.get_attribute("data-tenant") for e in chromium.find_elements(By.CSS_SELECTOR, "#sessions tbody tr")}
    assert tenants == {"relay"}
    assert not row_present(other)(chromium)
    assert not chromium.find_element(By.ID, "metrics-section").is_displayed()
    assert "tenant relay" in chromium.find_element(By.ID, "viewer").text
    screenshot(chromium, "dashboard-tenant.png")

    # The same page asked for the other tenant's session: refused as if it did not exist.
    chromium.get(f"{uigw.base}/ui#tenant=acme&session={other}")
    wait(chromium, lambda d: "no session" in d.find_element(By.ID, "status").text, "the refusal")
    assert not chromium.find_element(By.ID, "detail").is_displayed()
    assert_error_shape(get(uigw, session_path("acme", other), KEYS["relay"]), 404, "session_not_found")


def test_a_wrong_key_is_asked_again(chromium: Any, uigw: Gateway) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By

    chromium.get(f"{uigw.base}/ui")
    wait(chromium, lambda d: d.find_element(By.ID, "key-form").is_displayed(), "the key form")
    chromium.find_element(By.ID, "key-input").send_keys("sk-wrong")
    chromium.find_element(By.ID, "key-submit").click()
    wait(chromium, lambda d: "key" in d.find_element(By.ID, "key-error").text.lower(), "the key's refusal")
    assert not chromium.find_element(By.ID, "board").is_displayed()
    assert not chromium.find_elements(By.CSS_SELECTOR, "#sessions tbody tr")
    screenshot(chromium, "dashboard-wrong-key.png")


def test_an_open_gateway_refuses_a_browser_from_elsewhere(
        chromium: Any, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    address = outward_address()
    if address is None:
        pytest.skip("this machine has no non-loopback address to call from")
    gw = launch_open(tmp_path, upstream.url)
    try:
        session = new_session()
        drive(gw, session, compacting_turns(2)[0], None, key="unused")
        chromium.get(f"{gw.base}/ui")  # this machine: no key asked
        wait(chromium, row_present(session), "the session, from loopback")
        assert "local" in chromium.find_element(By.ID, "viewer").text
        screenshot(chromium, "dashboard-local.png")

        chromium.get(f"http://{address}:{gw.port}/ui")
        body = wait(chromium, lambda d: d.find_element(By.TAG_NAME, "body").text, "the refusal")
        assert "dashboard_loopback_only" in body and "loopback clients only" in body
        assert not chromium.find_elements(By.ID, "sessions")
        screenshot(chromium, "dashboard-refused.png")
    finally:
        stop_all([gw])
