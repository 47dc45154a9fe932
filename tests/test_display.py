"""Notebook displays: spec tables, TimeSteps, and images rendered as real PNGs."""

from __future__ import annotations

import base64
import pathlib
import re
import struct
import zlib

import dm_env
import numpy as np

import dm_env_rpc_client as dmr
from dm_env_rpc_client import display
from dm_env_rpc_client.server import Server

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _decode_png(data: bytes) -> np.ndarray:
    """A minimal PNG reader (8-bit, filter 0 rows, as display.png_bytes writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        chunks.setdefault(kind, b"")
        chunks[kind] += data[pos + 8 : pos + 8 + length]
        crc = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])[0]
        assert crc == zlib.crc32(kind + data[pos + 8 : pos + 8 + length])
        pos += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    channels = {0: 1, 2: 3, 6: 4}[colour]
    raw = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(height, -1)
    assert depth == 8 and (raw[:, 0] == 0).all()
    return raw[:, 1:].reshape(height, width, channels).squeeze()


def test_png_round_trips_pixels() -> None:
    rng = np.random.default_rng(0)
    for image in (
        rng.integers(0, 255, (5, 7, 3), dtype=np.uint8),
        rng.integers(0, 255, (4, 6), dtype=np.uint8),
        rng.integers(0, 255, (3, 2, 4), dtype=np.uint8),
    ):
        assert np.array_equal(_decode_png(display.png_bytes(image, scale=False)), image)


def test_timestep_with_an_image_renders_as_a_picture(tmp_path: pathlib.Path) -> None:
    yy, xx = np.mgrid[0:48, 0:64]
    image = np.stack([xx * 4, yy * 5, np.full_like(xx, 128)], axis=-1).astype(np.uint8)
    image[20:28, 28:36] = (255, 255, 255)  # a white square in the middle
    timestep = dm_env.transition(1.0, {"camera": image, "speed": np.arange(3.0)})
    shown = dmr.show(timestep)
    html = shown._repr_html_()
    assert html.count("data:image/png;base64,") == 1
    assert "array shape=(3,) dtype=float64 min=0.0 max=2.0" in html
    (tmp_path / "timestep.html").write_text(html)
    png = display.png_bytes(image)
    decoded = _decode_png(png)
    assert decoded.shape == (96, 128, 3)  # scaled up 2x to a 128-pixel side, nearest neighbour
    assert np.array_equal(decoded[::2, ::2], image)
    (tmp_path / "camera.png").write_bytes(png)
    # docs/assets/timestep_example.png is this same picture, committed and looked at by a person.
    assert (ROOT / "docs" / "assets" / "timestep_example.png").read_bytes() == png
    assert "camera: array shape=(48, 64, 3) dtype=uint8" in repr(shown)
    assert dmr.show(image)._repr_png_() == png
    assert dmr.show(np.arange(5))._repr_png_() is None


def test_catch_board_and_adaptor_tables(catch_server: Server) -> None:
    with dmr.connect(catch_server.address, timeout=10) as conn:
        env, _ = dmr.create_and_join_world(conn, {"rows": 6, "columns": 4}, {})
        html = env._repr_html_()
        assert "world-1" in html and catch_server.address in html
        assert "<td>paddle</td>" in html and "[-1, 1]" in html and "(6, 4)" in html
        assert "<caption>actions</caption>" in env.action_manager._repr_html_()
        env.reset()
        board = env.step({"paddle": 0}).observation["board"]
        picture = _decode_png(dmr.show(board)._repr_png_())
        assert picture.shape == (132, 88)  # float board in [0, 1] as grey, 22x nearest
        assert set(np.unique(picture)) == {0, 255}
        env.close()


def test_adaptor_html_text_repr_and_observation_spec_agree(catch_server: Server) -> None:
    env, _ = dmr.create_and_join_world(catch_server.address, {"rows": 5}, {}, timeout=10)
    try:
        html = env._repr_html_()
        observations = html.split("<caption>observations</caption>")[1]
        shown = set(re.findall(r"<tr><td>([^<]+)</td>", observations))
        assert shown == {"board"} == set(env.observation_spec())
        assert "observations=[board]" in repr(env)
    finally:
        env.close()


def test_reprs_print_plain_numbers(catch_server: Server) -> None:
    env, _ = dmr.create_and_join_world(catch_server.address, {"rows": 5}, {}, timeout=10)
    try:
        env.reset()
        timestep = env.step({"paddle": 0})
        assert isinstance(timestep.reward, np.generic)  # what the server sent: float32
        for text in (repr(dmr.show(timestep)), dmr.show(timestep)._repr_html_()):
            assert "np." not in text
            assert "reward=0.0" in text and "discount=1.0" in text
    finally:
        env.close()


def test_a_batch_shows_as_a_grid_of_its_worlds(catch_server: Server) -> None:
    with dmr.BatchedEnvironment.connect(
        catch_server.address, 3, create_world_settings={"rows": 5, "columns": 4}, timeout=10
    ) as envs:
        env_html = envs._repr_html_()
        assert "BatchedEnvironment" in env_html and "<td>paddle</td>" in env_html
        assert "<td>board</td>" in env_html and "<td>reward</td>" not in env_html
        envs.reset()
        batch = envs.step({"paddle": np.zeros(3, np.int8)})
        html = dmr.show(batch)._repr_html_()
        assert html == batch._repr_html_()  # shown by Jupyter as it is, too
        pictures = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
        assert len(pictures) == 3
        board = _decode_png(base64.b64decode(pictures[1]))
        assert board.shape[:2] == (5 * 26, 4 * 26)  # world 1's board, scaled up
        for world in range(3):
            assert f"world {world}: MID reward=0.0 discount=1.0" in html
        text = repr(dmr.show(batch))
        assert text.splitlines()[0] == "BatchedTimeStep of 3 worlds"
        assert "  world 2: MID reward=0.0 discount=1.0" in text
        assert "board: array shape=(3, 5, 4)" in text
        assert "np." not in text and "np." not in html
