"""Sampling from a run's page in a real browser (headless Chromium, as tests/test_ui_browser.py): prompts typed in
the Prompts box are sampled from the chosen checkpoint and the page shows the job finishing and each prompt with its
text; with the box empty, a dpo run samples its training data's first prompts (the job's log says so) and an sft
run with no sample.prompts shows the named error. Skipped where chromium or chromedriver is missing."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import yaml

from conftest import REPO
from helpers import without_others_samples
from test_ui_browser import browser, pytestmark, ui_server  # noqa: F401 - the fixture and the skip mark are used

DATA = REPO / "configs/examples/data/quickstart_preference.jsonl"


@pytest.fixture
def server(tmp_path, tiny_runs):
    """The UI on an outputs root with a dpo run (no sample.prompts) and an sft run whose sample.prompts is emptied;
    yields (url, root)."""
    pytest.importorskip("selenium")
    root = tmp_path / "outputs"
    shutil.copytree(tiny_runs["llm_dpo"], root / "dpo", ignore=without_others_samples)
    shutil.copytree(tiny_runs["llm"], root / "sft", ignore=without_others_samples)
    config = yaml.safe_load((root / "sft/config.yaml").read_text())
    config["sample"]["prompts"] = []
    (root / "sft/config.yaml").write_text(yaml.safe_dump(config))
    with ui_server(root) as url:
        yield url, root


def test_sample_with_typed_prompts_from_the_data_and_the_named_error(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url, root = server
    d = browser

    def text(css):  # read in one script: the page redraws every 2 s
        return d.execute_script("const e = document.querySelector(arguments[0]); return e ? e.innerText : null", css)

    def texts(css):
        return d.execute_script("return [...document.querySelectorAll(arguments[0])].map(e => e.innerText)", css)

    def wait(what, check, timeout=120):
        try:
            return WebDriverWait(d, timeout, poll_frequency=0.2).until(lambda _: check())
        except Exception as err:
            raise AssertionError(f"the page never showed {what}; sample job: {text('#sample-job')!r}, log: "
                                 f"{text('#sample-log')!r}, error banner: {text('#error')!r}") from err

    def click(css):  # found and clicked in one script: the list is redrawn every 2 s
        assert d.execute_script("const e = document.querySelector(arguments[0]); if (e) e.click(); return !!e", css)

    def finished_job(before):
        """The sample job's line once a job other than `before` has ended."""
        line = wait("the sample job ending", lambda: (t := text("#sample-job")) and t != before and "(exit" in t and t)
        return line

    # Typed prompts (a blank line and spaces dropped), sampled from checkpoint 1: each prompt with its text
    d.get(url + "#/run/dpo")
    wait("the checkpoints", lambda: text('#checkpoint-table tr[data-step="1"]'))
    box = d.find_element(By.ID, "sample-prompts")
    box.send_keys("what colour is the moon\n\n  what colour is the sea  ")
    time.sleep(2.5)  # a redraw of the page in between keeps what was typed
    assert box.get_attribute("value") == "what colour is the moon\n\n  what colour is the sea  "
    click('#checkpoint-table tr[data-step="1"] button.sample-from')
    line = finished_job(None)
    assert line.endswith(": done (exit 0)")
    [folder] = (root / "dpo/samples").glob("cli-*-step-000001")
    wait("the new samples", lambda: text("#sample-step") == folder.name)
    written = [json.loads(r) for r in (folder / "samples.jsonl").read_text().splitlines()]
    assert texts("#sample-grid .prompt") == ["what colour is the moon", "what colour is the sea"]
    assert texts("#sample-grid .text") == [r["completion"] for r in written] and all(texts("#sample-grid .text"))
    assert f"sample {root / 'dpo'} --checkpoint 1 --prompt=what colour is the moon --prompt=what colour is the sea" \
           in text("#sample-log")

    # The box emptied: the dpo run's final/ samples the first 3 prompts of its data, and the log says so
    box.clear()
    click("#sample-final")
    line = finished_job(line)
    assert line.endswith(": done (exit 0)")
    assert "sample: no --prompt and no sample.prompts: sampling the first 3 prompts of the training data" \
           in text("#sample-log")
    first = [json.loads(r)["prompt"] for r in DATA.read_text().splitlines()[:3]]
    wait("the data's prompts", lambda: texts("#sample-grid .prompt") == first)
    assert text("#sample-step").startswith("cli-") and text("#sample-step").endswith("-final")

    # An sft run with no sample.prompts and the box empty: the job fails and the page says which box to fill
    d.get(url + "#/run/sft")
    wait("the checkpoints", lambda: text('#checkpoint-table tr[data-step="1"]'))
    click("#sample-final")
    assert finished_job(None).endswith(": done (exit 2)")
    error = wait("the error", lambda: text("#sample-error"))
    assert error.startswith("error: sample: no prompt to sample from: no --prompt was given, sample.prompts is empty in")
    assert "(train.objective=sft: its training data is not split into prompts and answers)" in error
    assert error.endswith("fix: give --prompt TEXT (repeat it for more; in the web UI: the Prompts box, one prompt a "
                          "line), or set sample.prompts in the config")
    assert d.find_element(By.ID, "error").get_attribute("hidden") is not None  # the job failed, not the request
