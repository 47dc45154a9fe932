"""The watch page in a real browser: Debian's Chromium, headless, driven by Playwright.

Skipped, saying why, where ``/usr/bin/chromium`` (``apt-get install chromium``) or
Playwright's Python package (the ``test`` extra) is missing; Playwright never
downloads a browser here. The run steps 4 Catch worlds on two servers: the
embedded one in this process, and a child server that the test kills, so that
its worlds restart on the other one.

Set ``DMR_WATCH_SCREENSHOT=1`` to write the page's picture to docs/assets/watch.png.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from browser import CHROMIUM, CHROMIUM_ARGS
from conftest import wait_for
from test_watch import FAST, stepping

from dm_env_rpc_client import BatchedEnvironment
from dm_env_rpc_client.watch import Watcher

SCREENSHOT = pathlib.Path(__file__).parent.parent / "docs" / "assets" / "watch.png"


@pytest.fixture
def browser() -> Iterator[Any]:
    """A headless Chromium from Debian's package, or a skip that says what is missing."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no {CHROMIUM}: install Debian's package (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the test extra's playwright")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


class Boards:
    """A run observer that keeps a copy of every world's board, in the order they came."""

    def __init__(self) -> None:
        self.boards: dict[int, list[np.ndarray]] = {}
        self.steps = 0

    def on_steps(self, timestep: Any) -> None:
        for position, world in enumerate(timestep.env_ids.tolist()):
            self.boards.setdefault(world, []).append(timestep.observation["board"][position].copy())
        self.steps += len(timestep.env_ids)

    def on_event(self, event: Any) -> None:
        pass


_READ_WORLD = """(world) => {
  const card = document.getElementById("world-" + world);
  const canvas = card && card.querySelector("canvas");
  if (!canvas || !card.dataset.step) return null;
  const pixels = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height);
  return {step: +card.dataset.step, w: canvas.width, h: canvas.height,
          data: Array.from(pixels.data)};
}"""


# The returns chart's box (its section's content) and what is drawn in it: the canvas's
# place, its bitmap's size against its size on the page, and the rightmost drawn column.
_CHART = """() => {
  const canvas = document.getElementById("returns"), box = canvas.parentElement;
  const c = canvas.getBoundingClientRect(), b = box.getBoundingClientRect();
  const style = getComputedStyle(box), px = (name) => parseFloat(style[name]);
  const pixels = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
  let right = -1;
  for (let i = 3; i < pixels.length; i += 4) {
    if (pixels[i]) right = Math.max(right, ((i - 3) / 4) % canvas.width);
  }
  return {
    canvas: [c.left, c.top, c.right, c.bottom],
    box: [b.left + px("borderLeftWidth") + px("paddingLeft"),
          b.top + px("borderTopWidth") + px("paddingTop"),
          b.right - px("borderRightWidth") - px("paddingRight"),
          b.bottom - px("borderBottomWidth") - px("paddingBottom")],
    bitmap: [canvas.width, canvas.height], size: [c.width, c.height],
    ratio: window.devicePixelRatio, right: right,
  };
}"""


def _chart_inside_its_box(page: Any) -> dict[str, Any]:
    """The returns chart's geometry, once something is drawn in it."""
    assert wait_for(lambda: page.evaluate(_CHART)["right"] >= 0, timeout=10)
    chart: dict[str, Any] = page.evaluate(_CHART)
    (left, top, right, bottom), (box_left, box_top, box_right, box_bottom) = (
        chart["canvas"],
        chart["box"],
    )
    # The canvas lies within its box's content (no part of it past the border) ...
    assert box_left - 0.5 <= left and right <= box_right + 0.5, chart
    assert box_top - 0.5 <= top and bottom <= box_bottom + 0.5, chart
    # ... its bitmap is its size on the page (nothing drawn is stretched or cut off) ...
    assert chart["bitmap"] == [round(v * chart["ratio"]) for v in chart["size"]], chart
    # ... and the drawing spans it to its right edge (the newest returns), not past it.
    assert 0.9 * chart["bitmap"][0] <= chart["right"] < chart["bitmap"][0], chart
    return chart


def _shown(page: Any, world: int) -> dict[str, Any] | None:
    result: dict[str, Any] | None = page.evaluate(_READ_WORLD, world)
    return result


def test_the_page_shows_the_run_live_and_controls_it(
    browser: Any, catch_server: Any, server_process: Any, tmp_path: pathlib.Path
) -> None:
    doomed = server_process()
    batch = BatchedEnvironment.connect(
        [catch_server.address, doomed.address],
        4,
        seed=0,
        on_world_failure="restart",
        restart=FAST,
        step_timeout=5,
    )
    stop, boards = threading.Event(), Boards()
    watcher = Watcher(stop=stop).start()
    runner = stepping(batch, [boards, watcher], stop)
    page = browser.new_page(viewport={"width": 1100, "height": 640})
    try:
        page.goto(watcher.url)
        # Frames arrive, for every world, and change.
        assert wait_for(lambda: all(_shown(page, w) for w in range(4)), timeout=30)
        seen = set()

        def changed() -> bool:
            shown = _shown(page, 0)
            seen.add(tuple(shown["data"]) if shown else None)
            return len(seen) >= 3

        assert wait_for(changed, timeout=30)
        # A shown frame's pixels are the world's board at the step the page names.
        for world in range(4):
            shown = _shown(page, world)
            assert shown is not None and (shown["h"], shown["w"]) == (10, 5)
            board = boards.boards[world][shown["step"] - 1]
            pixels = np.asarray(shown["data"], np.uint8).reshape(10, 5, 4)
            expected = np.round(board * 255).astype(np.uint8)
            for channel in range(3):
                np.testing.assert_array_equal(pixels[..., channel], expected)
            assert (pixels[..., 3] == 255).all()
        # Pause stops the step count; resume lets it go on.
        page.click("#pause")
        assert wait_for(lambda: page.evaluate("watch.paused"), timeout=10) and watcher.paused
        ticks = page.evaluate("watch.ticks")
        assert wait_for(lambda: page.evaluate("watch.ticks") >= ticks + 3, timeout=10)
        steps, taken = page.evaluate("watch.steps"), boards.steps
        assert wait_for(lambda: page.evaluate("watch.ticks") >= ticks + 13, timeout=10)
        assert page.evaluate("watch.steps") == steps and boards.steps == taken
        page.click("#pause")  # now "Resume"
        assert wait_for(lambda: page.evaluate("watch.steps") > steps, timeout=10)
        # A killed server's worlds restart on the other one, and the page lists it.
        doomed.kill()
        restarted = "watch.events.filter(e => e.kind === 'restart').map(e => e.world)"
        assert wait_for(lambda: sorted(page.evaluate(restarted)) == [1, 3], timeout=30)
        assert page.locator("#events li.restart").count() == 2
        assert "restart: world 1: " in page.inner_text("#events")
        assert wait_for(lambda: page.evaluate("watch.returns.length") > 20, timeout=10)
        # The returns chart stays inside its box, at this width and after the page widens
        # (its box with it) and narrows again.
        _chart_inside_its_box(page)
        page.set_viewport_size({"width": 1400, "height": 640})
        assert wait_for(lambda: page.evaluate(_CHART)["bitmap"][0] > 300, timeout=10)
        _chart_inside_its_box(page)
        page.set_viewport_size({"width": 1100, "height": 640})
        assert wait_for(lambda: page.evaluate(_CHART)["bitmap"][0] < 260, timeout=10)
        _chart_inside_its_box(page)
        picture = tmp_path / "watch.png"
        page.screenshot(path=str(picture))
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if os.environ.get("DMR_WATCH_SCREENSHOT"):
            shutil.copyfile(picture, SCREENSHOT)
        # A closed tab frees its subscriber and its stream's thread.
        assert watcher.subscribers == 1
        page.close()
        assert wait_for(lambda: watcher.subscribers == 0, timeout=10)
        assert runner.is_alive()  # the run goes on without a page
    finally:
        stop.set()
        runner.join(timeout=30)
        watcher.close()
        batch.close(timeout=5)
    assert not runner.is_alive()
