"""Open the report in headless Chromium: no console error, nothing fetched, not blank, fits a phone.

Chromium and its driver come from Debian (installed here when missing and possible). The
screenshots and the page are kept under artifacts/report/ for a person to look at.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from report_samples import ARTIFACTS

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage")
PHONE = {"width": 390, "height": 844, "deviceScaleFactor": 2, "mobile": True}


def _install_chromium() -> str | None:
    """apt-get install chromium chromium-driver; the reason it cannot, or None on success."""
    if not shutil.which("apt-get"):
        return "chromium is missing and this system has no apt-get"
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return "chromium is missing and installing it with apt-get needs root"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"]):
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            return f"`{' '.join(cmd)}` timed out"
        if proc.returncode != 0:
            return f"`{' '.join(cmd)}` failed: {proc.stderr.strip()[-300:]}"
    return None


@pytest.fixture(scope="session")
def chromium_paths() -> tuple[str, str]:
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        reason = _install_chromium()
        if reason:
            pytest.skip(reason)
    chrome, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chrome and driver):
        pytest.skip("apt-get install chromium chromium-driver did not provide chromium and chromedriver")
    return chrome, driver


@pytest.fixture(scope="session")
def browser(chromium_paths, tmp_path_factory):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    chrome, driver_path = chromium_paths
    options = webdriver.ChromeOptions()
    options.binary_location = chrome
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def report_path(sample_report) -> Path:
    return sample_report


def _full_page_png(driver, path: Path, width: int) -> Path:
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(width, min(height + 140, 8000))
    driver.save_screenshot(str(path))
    return path


def _assert_not_blank(path: Path) -> None:
    from matplotlib.image import imread

    pixels = imread(path)[..., :3]
    non_white = (pixels.min(axis=-1) < 0.9).mean()
    assert pixels.std() > 0.05, f"{path} looks blank (pixel std {pixels.std():.3f})"
    assert non_white > 0.03, f"{path} is almost all white ({non_white:.1%} ink)"


def _page_state(driver) -> dict:
    return driver.execute_script("""
        const imgs = Array.from(document.images);
        return {
          images: imgs.length,
          loaded: imgs.filter(i => i.complete && i.naturalWidth > 0).length,
          fetched: performance.getEntriesByType('resource').map(e => e.name),
          scrollWidth: document.documentElement.scrollWidth,
          innerWidth: window.innerWidth,
          summary: document.getElementById('summary').innerText,
        };""")


def test_report_in_desktop_browser(browser, report_path):
    browser.get(report_path.as_uri())
    state = _page_state(browser)
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []
    assert state["images"] == 4 and state["loaded"] == 4
    assert [u for u in state["fetched"] if not u.startswith(("data:", "file:"))] == []
    assert state["summary"].startswith("The optimal plan fits 80.0 MiB at +13% step time")
    _assert_not_blank(_full_page_png(browser, ARTIFACTS / "browser-desktop.png", 1280))


def test_report_on_a_phone_has_no_sideways_scroll(browser, report_path):
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", PHONE)
    try:
        browser.get(report_path.as_uri())
        state = _page_state(browser)
        assert state["loaded"] == 4
        assert state["scrollWidth"] <= state["innerWidth"], state  # wide tables scroll inside their box
        browser.save_screenshot(str(ARTIFACTS / "browser-phone.png"))
        assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    _assert_not_blank(ARTIFACTS / "browser-phone.png")
