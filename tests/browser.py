"""Headless Chromium for the browser tests: a `chromium` webdriver fixture and `artifact_path`.

Debian's chromium and chromedriver are used by their paths, so Selenium Manager never looks
for (or downloads) a browser or a driver. Without them the browser tests skip.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import pytest

if TYPE_CHECKING:  # selenium is imported only when a browser test runs
    from selenium.webdriver.remote.webdriver import WebDriver

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
MISSING = "headless browser tests need Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,1000")
ARTIFACTS = Path(__file__).parent / "artifacts"
WAIT_S = 30
"""How long a page may take to show what a test waits for (a busy machine renders slowly)."""


def artifact_path(name: str) -> Path:
    """Where a test writes a screenshot or page dump: $CTXGATE_ARTIFACTS or tests/artifacts/."""
    folder = Path(os.environ.get("CTXGATE_ARTIFACTS") or ARTIFACTS)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def wait(driver: Any, condition: Callable[[Any], Any], what: str) -> Any:
    """`condition(driver)` once it is truthy: polled, never a fixed sleep."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(condition, message=f"waiting for {what}")


def chromium_available() -> bool:
    return CHROMIUM.exists() and CHROMEDRIVER.exists()


@pytest.fixture
def chromium() -> Iterator[WebDriver]:
    """A fresh headless Chromium (its own profile directory), quit after the test."""
    if not chromium_available():
        pytest.skip(MISSING)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="ctxgate-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
