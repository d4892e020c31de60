"""The web playground in a real browser: headless Chromium (Debian's chromium and chromium-driver, installed by
`.ci/run`) driven by Selenium against `q3tts serve` with tiny models. A screenshot of each run is kept in
`$Q3TTS_ARTIFACTS` (default: the test's temporary folder)."""

from __future__ import annotations

import io
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
webdriver = pytest.importorskip("selenium.webdriver")

import httpx  # noqa: E402
import soundfile as sf  # noqa: E402

from q3tts.server import ServerConfig  # noqa: E402
from tests.server.harness import ServerThread, load_tiny  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER) and os.environ.get("Q3TTS_REQUIRE_BROWSER") != "1",
                                reason="headless Chromium and chromedriver are not installed (`.ci/run` installs them)")


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=900,1300",
                 "--autoplay-policy=no-user-gesture-required", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


def artifacts(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("Q3TTS_ARTIFACTS", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def wait_for(driver, script: str, timeout: float = 60):
    deadline = time.time() + timeout
    while not (value := driver.execute_script(f"return {script}")):
        assert time.time() < deadline, f"timed out waiting for {script}; page state: " \
                                       f"{driver.execute_script('return JSON.stringify(window.q3tts)')}"
        time.sleep(0.1)
    return value


def console_errors(driver) -> list[str]:
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


@pytest.mark.slow(reason="a real browser plays a streamed answer (tests/SLOW.md)")
def test_playground_streams_speech(browser, tmp_path):
    """The page loads without console errors, lists the speakers, streams a request's audio into the page (first
    audio before the whole clip is done) and offers it for download."""
    from selenium.webdriver.common.by import By

    config = ServerConfig(model="tiny", device="cpu", max_running=2, warmup=False)
    with ServerThread(config, load_tiny("tiny", tmp_path)) as server:
        browser.get(server.url + "/")
        wait_for(browser, "window.q3tts.ready")
        assert "ryan" in browser.execute_script("return window.q3tts.voices")
        text = browser.find_element(By.ID, "text")
        text.clear()
        text.send_keys("Hello from the browser.")  # (short: a random model runs to the runaway guard's limit)
        browser.execute_script("document.getElementById('voice').value = 'serena'")
        browser.find_element(By.ID, "speak").click()
        wait_for(browser, "window.q3tts.rtf !== null", timeout=300)
        state = browser.execute_script("return window.q3tts")
        assert state["error"] is None and state["chunks"] >= 2 and state["samples"] > 0
        assert state["firstAudioMs"] is not None and state["firstAudioMs"] < 1000 * state["samples"] / 24000
        download = browser.find_element(By.ID, "download")
        assert download.is_displayed() and download.get_attribute("href").startswith("blob:")
        browser.save_screenshot(str(artifacts(tmp_path) / "playground-speech.png"))
        assert console_errors(browser) == []


def test_playground_uploads_a_voice(browser, tmp_path):
    """On a Base checkpoint the page uploads a recording, lists the new voice and speaks with it."""
    from selenium.webdriver.common.by import By

    reference = tmp_path / "me.wav"
    t = np.arange(24000) / 24000
    sf.write(reference, (0.3 * np.sin(2 * np.pi * 180 * t) * (1 + np.sin(2 * np.pi * 4 * t))).astype(np.float32),
             24000)
    config = ServerConfig(model="tiny-base", device="cpu", max_running=2, warmup=False)
    with ServerThread(config, load_tiny("tiny-base", tmp_path)) as server:
        browser.get(server.url + "/")
        wait_for(browser, "window.q3tts.ready")
        assert browser.find_element(By.ID, "upload-box").is_displayed()
        browser.find_element(By.ID, "ref-file").send_keys(str(reference))
        browser.find_element(By.ID, "ref-text").send_keys("Hello, this is my voice.")
        browser.find_element(By.ID, "voice-name").send_keys("me")
        browser.find_element(By.ID, "upload").click()
        wait_for(browser, "window.q3tts.uploads === 1")
        voices = httpx.get(server.url + "/v1/audio/voices").json()["data"]
        assert [v["name"] for v in voices] == ["me"]
        assert browser.execute_script("return document.getElementById('voice').value") == voices[0]["id"]
        text = browser.find_element(By.ID, "text")  # (short: a random model runs to the runaway guard's limit,
        text.clear()  # 20 frames a text token + 10 s, and the page's own example once took over 120 s here)
        text.send_keys("Hello.")
        browser.find_element(By.ID, "speak").click()
        wait_for(browser, "window.q3tts.rtf !== null", timeout=300)
        assert browser.execute_script("return window.q3tts.error") is None
        browser.save_screenshot(str(artifacts(tmp_path) / "playground-upload.png"))
        assert console_errors(browser) == []


def test_playground_page_is_self_contained():
    """No CDN or other origin: the page works offline."""
    from q3tts.server.routes.playground import PAGE

    page = PAGE.read_text()
    assert "http://" not in page and "https://" not in page and "<script src" not in page
    assert io.StringIO(page).read().count("/v1/audio/speech") == 1
