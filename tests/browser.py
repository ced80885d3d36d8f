"""Headless Chromium (Debian's ``chromium`` package) for page tests: the DOM after the
page's scripts ran, and screenshots. Skips when no chromium is installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile

import pytest

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--no-first-run", "--disable-dev-shm-usage")


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no headless chromium (apt-get install chromium)")


def _run(args: list[str], timeout: float = 120.0) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="llmserve-chromium-") as profile:
        return subprocess.run([chromium(), *FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "HOME": profile})


def dump_dom(url: str, budget_ms: int = 5000) -> str:
    """The page's DOM after ``budget_ms`` of (virtual) time: its scripts have run."""
    r = _run([f"--virtual-time-budget={budget_ms}", "--dump-dom", url])
    assert r.returncode == 0 and "<html" in r.stdout, r.stderr[-2000:]
    return r.stdout


def screenshot(url: str, path: str, size: str = "1300,1000", budget_ms: int = 5000) -> None:
    r = _run([f"--virtual-time-budget={budget_ms}", f"--window-size={size}",
              f"--screenshot={path}", url])
    assert r.returncode == 0 and os.path.getsize(path) > 0, r.stderr[-2000:]


def chart_points(dom: str) -> dict[str, int]:
    """``{chart id: points drawn}`` of the dashboard page (its ``data-points``)."""
    return {m.group(1): int(m.group(2)) for m in re.finditer(
        r'id="chart-([\w-]+)".*?data-points="(\d+)"', dom, re.DOTALL)}
