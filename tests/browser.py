"""Headless Chromium for the dashboard's tests: the system's browser (Debian's ``chromium``; never one
downloaded at run time), driven by Playwright. Missing in CI (``CI`` set): the tests fail saying what to
install; elsewhere they are skipped with that reason."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM_ENV = "TIDAL_CHROMIUM"  # a browser other than the one on PATH
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts" / "dashboard"


def chromium_path() -> str | None:
    return shutil.which(os.environ.get(CHROMIUM_ENV) or "chromium") or shutil.which("chromium-browser")


def _missing(why: str) -> None:
    msg = (f"{why}: the dashboard's browser tests need Debian's chromium (apt-get install chromium; .ci/run "
           f"installs it) and playwright (pip install -e '.[dev]'), or {CHROMIUM_ENV}=<browser>")
    if os.environ.get("CI"):
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg)


@pytest.fixture(scope="module")
def browser() -> Iterator:
    path = chromium_path()
    if path is None:
        _missing(f"no {os.environ.get(CHROMIUM_ENV) or 'chromium'} found")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the playwright package is not installed")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=path, args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            yield b
        finally:
            b.close()


class Tab:
    """A page with its console errors and uncaught exceptions collected."""

    def __init__(self, browser, url: str) -> None:
        self.ctx = browser.new_context(viewport={"width": 1300, "height": 900})
        self.page = self.ctx.new_page()
        self.page.set_default_timeout(30_000)
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(f"console {m.type}: {m.text}")
                     if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.url = url

    def sign_in(self, token: str) -> None:
        self.page.goto(self.url + "/dashboard")
        self.page.fill("#token", token)
        self.page.click("#login-form button[type=submit]")
        self.page.wait_for_selector("#nav:not([hidden])")

    def go(self, route: str, ready: str) -> None:
        self.page.evaluate("r => { location.hash = r; }", route)
        self.page.wait_for_selector(ready)

    def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def close(self) -> None:
        self.ctx.close()
