"""The web UI in a real headless browser: the UI started as its own process on a free port, Debian's chromium
driven by Selenium (offline), and the waits and lookups the browser tests share."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tests.helpers import REPO
from tests.helpers.ui import reap_runs

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
INSTALL = ("apt-get install -y --no-install-recommends chromium chromium-driver, and pip install -r "
           "requirements-dev.txt (selenium)")
try:
    import selenium  # noqa: F401
    HAVE_SELENIUM = True
except ImportError:
    HAVE_SELENIUM = False
MISSING = not HAVE_SELENIUM or CHROMIUM is None or CHROMEDRIVER is None
WHY_SKIPPED = f"a real-browser test needs Debian's chromium and chromedriver and selenium: {INSTALL}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_ui(root: Path) -> Iterator[str]:
    """`python train_ui.py` over the repository and `root`, as a user starts it; its URL. Stopped afterwards, with
    any trainer it ran; its output is `root`/ui-<port>.log."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log_path = root / f"ui-{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "train_ui.py", "--port", str(port), "--root", str(REPO),
                                    "--root", str(root)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert process.poll() is None, log_path.read_text()
                    time.sleep(0.2)
            yield f"http://127.0.0.1:{port}"
        finally:
            process.terminate()  # a connection the browser keeps open can hold its shutdown for 30 s
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            reap_runs(root)


@contextmanager
def chrome() -> Iterator:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--disable-background-networking", "--disable-component-update", "--no-first-run",
                     "--window-size=1400,1000"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def waiting(browser, timeout: float = 60):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # Elements are replaced under the driver's feet (HTMX swaps).
    return WebDriverWait(browser, timeout, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,))


def by_id(browser, element_id: str):
    from selenium.webdriver.common.by import By

    return browser.find_element(By.ID, element_id)


def click(browser, element) -> None:
    """Click an element after scrolling it to the middle of the window (a sticky toolbar may cover the top)."""
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
    element.click()


def fill(browser, element_id: str, value: str) -> None:
    field = by_id(browser, element_id)
    field.clear()
    field.send_keys(value)


def console_errors(browser) -> list[str]:
    """The console's errors since the last call (the log is read once)."""
    return [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
