"""The web UI in a real browser: Debian's headless Chromium driven by Debian's chromedriver through selenium
(nothing downloaded). It starts the quickstart from the New run page (after the validator marks a typo at its line),
watches the step counter and the loss chart advance, opens the samples, stops the run and resumes it, compares it
with another run and sees a deleted run folder disappear, asserting what the page shows; each page's screenshot
goes to docs/ui-*.png. Skipped, not failed, where chromium or chromedriver is missing (.ci/run installs both)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from conftest import REPO
from helpers import without_others_samples, long_quickstart
from toolkit.ui.jobs import JobQueue

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").is_file() else None)
pytestmark = pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                                reason="chromium or chromedriver is not installed (`apt-get install -y chromium "
                                       "chromium-driver`; .ci/run does it when root)")
DOCS = REPO / "docs"
# The quickstart with samples every 2 steps (the reference run has them at steps 1 and 2: the same step to compare).
QUICKSTART = long_quickstart("ui_quickstart", sample_every=2)


@pytest.fixture
def server(tmp_path, tiny_runs):
    """`python -m toolkit ui --port 0` on an outputs root with a finished tiny run; yields (url, root)."""
    pytest.importorskip("selenium")
    root = tmp_path / "outputs"
    root.mkdir()
    shutil.copytree(tiny_runs["llm"], root / "reference", ignore=without_others_samples)
    shutil.copytree(tiny_runs["llm"], root / "old_run", ignore=without_others_samples)
    with ui_server(root) as url:
        yield url, root


@contextmanager
def ui_server(root: Path) -> Iterator[str]:
    """`python -m toolkit ui --port 0` on the outputs root `root`; yields its URL. Its jobs are killed after."""
    proc = subprocess.Popen([sys.executable, "-m", "toolkit", "ui", "--port", "0", "--outputs", str(root)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = [proc.stdout.readline() for _ in range(2)]
        assert lines[1].strip().startswith("open http://127.0.0.1:"), lines
        yield lines[1].split("open ", 1)[1].strip()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        proc.stdout.close()
        for job in JobQueue(root).active():
            if job.state == "running" and job.pid:
                try:
                    os.killpg(job.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.fixture
def browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900",
                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def test_quickstart_from_the_browser(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    url, root = server
    d = browser

    def wait(what, check, timeout=120):
        try:
            return WebDriverWait(d, timeout, poll_frequency=0.2).until(lambda _: check())
        except Exception as err:
            raise AssertionError(f"the page never showed {what}; error banner: {text('#error')!r}") from err

    def text(css):  # read in one script: the page redraws often, an element found first could be gone when read
        return d.execute_script("const e = document.querySelector(arguments[0]); return e ? e.innerText : null", css)

    def click(element_id):  # the page may redraw the button between finding it and clicking it: find it again
        from selenium.common.exceptions import StaleElementReferenceException

        for _ in range(20):
            try:
                return d.find_element(By.ID, element_id).click()
            except StaleElementReferenceException:
                time.sleep(0.1)
        raise AssertionError(f"#{element_id} kept being redrawn before it could be clicked")

    def attribute(css, name):
        return d.execute_script("return document.querySelector(arguments[0]).getAttribute(arguments[1])", css, name)

    def status():
        return text("#run-status .status")

    def step():
        value = text("#step")
        return int(value) if value and value.isdigit() else 0

    def screenshot(name):
        height = d.execute_script("return document.documentElement.scrollHeight")
        d.set_window_size(1280, min(max(height + 120, 700), 2000))
        assert d.save_screenshot(str(DOCS / f"ui-{name}.png"))
        d.set_window_size(1280, 900)

    # New run: the quickstart, checked as it is typed; a typo is shown at its line and blocks the start
    d.get(url + "#/new")
    wait("the example", lambda: "quickstart_llm" in d.find_element(By.ID, "yaml").get_attribute("value"))
    d.execute_script("const t = document.getElementById('yaml'); t.value = arguments[0];"
                     "t.dispatchEvent(new Event('input'));", QUICKSTART)
    wait("the config checked OK", lambda: text("#valid"))
    editor = d.find_element(By.ID, "yaml")
    editor.click()
    editor.send_keys(Keys.CONTROL, Keys.END)
    editor.send_keys("bogus: 1")
    line = len(QUICKSTART.splitlines()) + 1
    problem = wait("the typo's problem", lambda: text(f'#problems li[data-line="{line}"]'))
    assert problem.startswith(f"line {line}: unknown key 'bogus' in line {line}")
    assert [g.text for g in d.find_elements(By.CSS_SELECTOR, "#gutter .bad")] == [str(line)]
    assert not d.find_element(By.ID, "start").is_enabled()
    screenshot("new")
    editor.send_keys(Keys.BACKSPACE * len("bogus: 1"))
    wait("the config checked OK again", lambda: text("#valid") and not d.find_elements(By.CSS_SELECTOR, "#gutter .bad"))
    assert text("#run-name") == "run folder: ui_quickstart"
    wait("the start button", lambda: d.find_element(By.ID, "start").is_enabled())
    click("start")

    # A run: the step counter and the loss chart advance
    wait("the run page", lambda: d.current_url.endswith("#/run/ui_quickstart"))
    wait("the running status", lambda: status() == "running")
    first = wait("a first step", step)
    points = int(attribute("#chart-loss", "data-points"))
    wait("later steps", lambda: step() >= first + 3)
    wait("a longer loss chart", lambda: int(attribute("#chart-loss", "data-points")) > points)
    assert re.fullmatch(r"step \d+: \d+\.\d{4}", text("#chart-loss .last"))
    assert d.execute_script("return document.querySelectorAll('#chart-loss polyline.series').length") == 2
    # the samples: a grid of the latest step's, and a slider back to the first sampling round
    wait("two sampling rounds", lambda: text("#sample-slider") is not None and attribute("#sample-slider", "max") != "0")
    d.execute_script("const s = document.getElementById('sample-slider'); s.value = 0; s.dispatchEvent(new Event('input'));")
    assert text("#sample-step") == "step 2"
    assert d.execute_script("return [...document.querySelectorAll('#sample-grid .prompt')].map(e => e.innerText)") == [
        "the red circle"]
    assert text("#decision-table") and "train.compile" in text("#decision-table")
    screenshot("run")

    # Stop (a checkpoint is saved), then resume from it
    click("stop")
    wait("the interrupted status", lambda: status() == "interrupted")
    stopped = step()
    wait("the checkpoint", lambda: text(f'#checkpoint-table tr[data-step="{stopped}"]'))
    click("resume")
    wait("the run running again", lambda: status() == "running")
    wait("steps after the resume", lambda: step() > stopped)
    resumed = f"resumed from {root / 'ui_quickstart' / 'checkpoints' / f'step-{stopped:06d}'} (step {stopped})"
    wait("the resume in the job's log", lambda: resumed in (text("#job-log") or ""))
    click("stop")
    wait("the interrupted status again", lambda: status() == "interrupted")

    # Runs: a deleted run folder disappears without an error; then compare two runs
    d.get(url + "#/")
    wait("the runs", lambda: text('#runs-table tr[data-run="old_run"]'))
    shutil.rmtree(root / "old_run")
    wait("the deleted run gone", lambda: not d.find_elements(By.CSS_SELECTOR, '#runs-table tr[data-run="old_run"]'))
    assert d.find_element(By.ID, "error").get_attribute("hidden") is not None
    rows = {r.get_attribute("data-run"): r for r in d.find_elements(By.CSS_SELECTOR, "#runs-table tbody tr")}
    assert sorted(rows) == ["reference", "ui_quickstart"]
    assert rows["ui_quickstart"].find_element(By.CSS_SELECTOR, ".status").text == "interrupted"
    assert rows["reference"].find_element(By.CSS_SELECTOR, ".step").text == "2 / 2"
    for row in rows.values():
        row.find_element(By.CSS_SELECTOR, "input[type=checkbox]").click()
    screenshot("runs")
    click("compare-selected")
    wait("the compare chart", lambda: int(d.find_element(By.ID, "chart-compare").get_attribute("data-points") or 0) > 2)
    names = [p.get_attribute("data-name") for p in d.find_elements(By.CSS_SELECTOR, "#chart-compare polyline")]
    assert sorted(names) == ["reference", "ui_quickstart"]
    diff = {r.find_elements(By.TAG_NAME, "td")[0].text: [c.text for c in r.find_elements(By.TAG_NAME, "td")[1:]]
            for r in d.find_elements(By.CSS_SELECTOR, "#diff tbody tr")}
    order = [e.get_attribute("data-run") for e in d.find_elements(By.CSS_SELECTOR, "#cmp-samples figure")]
    assert diff["train.steps"] == [{"reference": "2", "ui_quickstart": "2000"}[n] for n in order]
    assert d.find_element(By.ID, "cmp-step").get_attribute("value") == "step 2"
    assert d.find_element(By.ID, "cmp-prompt").get_attribute("value") == "the red circle"
    assert all(f.find_elements(By.CSS_SELECTOR, ".text") for f in d.find_elements(By.CSS_SELECTOR, "#cmp-samples figure"))
    screenshot("compare")
