"""Refresh the dashboard screenshots in docs/images/ (run from the repository root).

    python tools/dashboard_screenshots.py --root keel-out

Serves `keel dashboard --root ROOT` on a free port, opens each view in headless Chromium (the
same browser set-up as tests/dashboard/browser.py: Debian's chromium and chromium-driver,
Selenium) and writes docs/images/dashboard-{runs,run,data,jobs}.png, 1280 px wide, as 8-bit
palette PNGs (Pillow), so they stay small in git. A prefix with two runs, data stages and a job
(as tests/dashboard/conftest.py builds) shows every view filled in.
"""

from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "dashboard"))
from browser import chromium, wait_for

IMAGES = Path("docs/images")
VIEWS = {
    "runs": ("#runs", "#runs-table tbody tr"),
    "run": (None, "#run-loss .u-over"),
    "data": ("#data", "#stages-table tbody tr"),
    "jobs": ("#jobs", "#steps-table tbody tr"),
}
"""name -> (hash, a CSS selector showing the view has drawn); "run" opens the first run."""
SETTLE_SECONDS = 1.0


def serve(root: str) -> tuple[subprocess.Popen, str]:
    log = Path(tempfile.mkdtemp(prefix="keel-screenshots-")) / "dashboard.log"
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "keel", "dashboard", "--root", root, "--port", "0"],
            stderr=stderr,
        )
    deadline = time.monotonic() + 60
    while not (match := re.search(r"at (http://\S+?)/? ", log.read_text())):
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"error: keel dashboard did not start: {log.read_text()}")
        time.sleep(0.1)
    return process, match.group(1)


def save_small(png: bytes, path: Path) -> None:
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    image.quantize(colors=64).save(path, optimize=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="keel-out", help="The prefix to show.")
    args = parser.parse_args()
    from selenium.webdriver.common.by import By

    IMAGES.mkdir(parents=True, exist_ok=True)
    process, url = serve(args.root)
    try:
        with chromium() as driver:
            for name, (fragment, ready) in VIEWS.items():
                if fragment is None:
                    driver.get(f"{url}/#runs")
                    driver.refresh()
                    link = wait_for(
                        driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#runs-table a")
                    )
                    link[0].click()
                else:
                    driver.get(f"{url}/{fragment}")
                    driver.refresh()
                wait_for(driver, lambda d, s=ready: d.find_elements(By.CSS_SELECTOR, s), 30)
                time.sleep(SETTLE_SECONDS)
                height = driver.execute_script("return document.body.scrollHeight")
                driver.set_window_size(1280, min(max(height + 40, 900), 1600))
                time.sleep(0.3)
                path = IMAGES / f"dashboard-{name}.png"
                save_small(driver.get_screenshot_as_png(), path)
                print(f"{path}: {path.stat().st_size:,} bytes")
    finally:
        process.terminate()
        process.wait(timeout=30)


if __name__ == "__main__":
    main()
