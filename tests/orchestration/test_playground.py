"""The playground (`GET /`): served by the app itself, and used in a real headless browser as a person would.

The browser is Debian's chromium driven by selenium; `make browser` (a prerequisite of `make test`) installs it.
Without it the browser test fails and says what to install: it never skips. It keeps a screenshot of the page,
images and all, at `tests/artifacts/playground.png`.
"""

from __future__ import annotations

import base64
import hashlib
import re
import shutil
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from orchestration.playground import ASSETS, mount

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
SCREENSHOT = ARTIFACTS / "playground.png"
PAGE_LOAD_S = 60
GENERATE_S = 180  # two 64x64 images with the prompt rewritten, on a loaded 2-core box
INSTALL_HINT = "run `make browser` (as root it installs them: apt-get install chromium chromium-driver fonts-liberation)"


def test_playground_page_and_assets_are_served_from_the_package_relative_to_the_app_prefix():
    api = FastAPI()
    mount(api, videos=False)
    with TestClient(api, root_path="/off") as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<base href="/off/">' in page.text  # every URL in the page is relative to the app's own prefix
        assert '<button type="button" id="run-video" hidden' in page.text  # no videos served: no video button
        texts = [page.text]
        for name in ASSETS:
            assert f'"playground/{name}"' in page.text
            asset = client.get(f"/playground/{name}")
            assert asset.status_code == 200 and asset.text.strip()
            texts.append(asset.text)
        assert client.get("/playground/__init__.py").status_code == 404  # only the listed assets leave the package
    for text in texts:  # nothing fetched from another host: no CDN, no web font
        assert not re.search(r"(https?:)?//[\w-]+(\.[\w-]+)+", text)


def browser():
    """A headless chromium, or a failure that says what to install."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.fail(f"the playground test needs chromium and chromedriver on PATH: {INSTALL_HINT}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium  # both paths given: selenium looks nothing up elsewhere
    for flag in ("--headless", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1100,1300"):
        options.add_argument(flag)
    session = webdriver.Chrome(options=options, service=Service(executable_path=driver))
    session.set_page_load_timeout(PAGE_LOAD_S)
    session.set_script_timeout(30)
    return session


def decoded_widths(driver) -> list[int]:
    return driver.execute_script(
        "return [...document.querySelectorAll('.card:not(.pending) .frame img')].map(i => i.complete ? i.naturalWidth : 0)")


def fill(driver, **fields):
    for name, value in fields.items():
        element = driver.find_element("name", name)
        element.clear()
        element.send_keys(str(value))


@pytest.mark.slow
def test_playground_generates_two_images_and_reproduces_one_identically_in_a_real_browser(server):
    from selenium.webdriver.support.select import Select
    from selenium.webdriver.support.wait import WebDriverWait

    driver = browser()
    try:
        driver.get(f"{server}/")
        assert driver.title == "omniserve playground"
        fill(driver, prompt="a red fox in the snow", n=2, seed=424242, num_inference_steps=4)
        Select(driver.find_element("name", "size")).select_by_visible_text("64x64")
        Select(driver.find_element("name", "partial_images")).select_by_value("2")  # streamed
        driver.find_element("id", "run").click()

        WebDriverWait(driver, GENERATE_S).until(lambda d: len(decoded_widths(d)) == 2 and all(decoded_widths(d)))
        assert decoded_widths(driver) == [64, 64]
        status = driver.find_element("id", "status").text
        assert "2 image(s)" in status and "not streamed" not in status, status
        partials = driver.execute_script(  # each image's partial images, as the stream delivered them, decoded
            "return [...document.querySelectorAll('.card')].map(c => [...c.querySelectorAll('.partials img')].map(i => i.naturalWidth))")
        assert all(1 <= len(widths) <= 2 and all(widths) for widths in partials), partials
        cards = driver.find_elements("css selector", ".card")
        seeds = [int(card.find_element("css selector", ".seed").text) for card in cards]
        assert len(set(seeds)) == 2
        for card in cards:  # the sha256 shown is of the very bytes the page shows
            png = base64.b64decode(card.find_element("css selector", ".frame img").get_attribute("src").split(",", 1)[1])
            assert card.find_element("css selector", ".sha256").text == hashlib.sha256(png).hexdigest()
            assert card.find_element("css selector", ".revised").text.strip() not in ("", "-")
            assert int(card.find_element("css selector", ".batch").text) >= 1
        for stage in ("llm", "diffusion"):  # the app under test runs both stages invariant
            assert driver.find_element("css selector", f'tr[data-stage="{stage}"] .switch').text == "on"

        cards[1].find_element("css selector", ".reproduce").click()
        verdict = cards[1].find_element("css selector", ".verdict")
        WebDriverWait(driver, GENERATE_S).until(lambda d: verdict.text in ("identical", "differs") or "failed" in verdict.text)
        assert verdict.text == "identical"
        save_screenshot(driver)
    finally:
        driver.quit()


def save_screenshot(driver) -> None:
    """The page as a person sees it, kept as a test artifact; it must be a PNG of the page, not a blank one."""
    from PIL import Image

    ARTIFACTS.mkdir(exist_ok=True)
    width, height = driver.execute_script(
        "return [document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {  # the whole page, every card with its verdict
        "format": "png", "captureBeyondViewport": True, "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}})
    SCREENSHOT.write_bytes(base64.b64decode(shot["data"]))
    with Image.open(SCREENSHOT) as shot:
        assert shot.format == "PNG" and shot.width >= 800 and shot.height >= 600
        colours = shot.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colours is None or len(colours) > 500, "a blank or nearly blank screenshot"  # text + noise images


@pytest.mark.slow
def test_playground_makes_a_video_and_plays_the_mp4_whose_sha256_it_shows_in_a_real_browser(server):
    from selenium.webdriver.support.wait import WebDriverWait

    driver = browser()
    try:
        driver.get(f"{server}/")
        button = driver.find_element("id", "run-video")
        assert button.is_displayed()  # the app at "/" serves videos
        fill(driver, prompt="a paper boat on a pond", seed=31337, num_inference_steps=4)
        button.click()
        WebDriverWait(driver, GENERATE_S).until(lambda d: d.find_elements("css selector", ".card.video:not(.pending)")
                                                or "failed" in d.find_element("id", "status").text)
        card = driver.find_element("css selector", ".card.video")
        assert card.find_element("css selector", ".verdict").text == "file matches its sha256"
        assert card.find_element("css selector", ".seed").text == "31337"
        assert card.find_element("css selector", ".frames").text.startswith("9 (1 s at 8 fps)")
        # The browser decodes the MP4 itself: its size, and a first frame shown.
        WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.querySelector('.card.video video').readyState") >= 2)
        assert driver.execute_script("const v = document.querySelector('.card.video video'); return [v.videoWidth, v.videoHeight]") == [64, 64]
        assert "a video of 9 frames" in driver.find_element("id", "status").text
    finally:
        driver.quit()
