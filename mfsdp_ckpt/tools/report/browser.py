"""A PNG of a report page, drawn by a headless Chromium (or Chrome) found on ``PATH``."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

from mfsdp_ckpt.errors import CheckpointError
from mfsdp_ckpt.tools.report.output import check_report_file

__all__ = ["BROWSERS", "find_browser", "screenshot"]

#: the names looked for, in order (``MFSDP_BROWSER`` names another binary)
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_browser() -> str:
    """The browser binary, or a one-line error saying which were looked for."""
    named = os.environ.get("MFSDP_BROWSER")
    if named:
        found = shutil.which(named)
        if found is None:
            raise CheckpointError(f"MFSDP_BROWSER={named}: no such browser")
        return found
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    raise CheckpointError(
        f"--png needs a headless Chromium or Chrome: none of {', '.join(BROWSERS)} is on PATH "
        "(Debian: apt-get install chromium; or set MFSDP_BROWSER); --html works without one"
    )


def browser_args(browser: str) -> list[str]:
    """A headless run with no network (every host resolves to nothing, no proxy reachable)."""
    return [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--host-resolver-rules=MAP * ~NOTFOUND",
        "--proxy-server=127.0.0.1:9",
        "--no-first-run",
    ]


def screenshot(html_path: str, png: str, width: int = 1280, height: int = 2000, timeout: float = 60) -> str:
    """Render ``html_path`` and write ``png`` (whole or not at all)."""
    browser = find_browser()
    check_report_file(png, "--png")
    directory = os.path.dirname(os.path.abspath(png))
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        raise CheckpointError(f"{png}: cannot write the screenshot: {directory} is not a writable directory")
    with tempfile.TemporaryDirectory(prefix="mfsdp-browser-") as profile:
        tmp = os.path.join(profile, "shot.png")
        cmd = [
            *browser_args(browser),
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            f"--screenshot={tmp}",
            "file://" + os.path.abspath(html_path),
        ]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        if run.returncode != 0 or not os.path.exists(tmp):
            last = (run.stderr.strip().splitlines() or ["no output"])[-1]
            raise CheckpointError(f"{browser}: the screenshot failed (exit {run.returncode}): {last}")
        shutil.move(tmp, png)
    return png
