"""The declared dependency floors work: install exactly them and run a real round trip.

setup.py declares minimum versions for the runtime dependencies. This test
builds a fresh virtual environment with every runtime dependency pinned to its
floor, installs the package without letting pip upgrade anything, and steps the
embedded Catch server through the SDK. It needs the package registry (CI has it).
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import textwrap
import venv

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

SMOKE = """
import numpy as np
import google.protobuf, grpc
import dm_env_rpc_client as dmr
from dm_env_rpc_client.server.catch import Catch

print("protobuf", google.protobuf.__version__, "grpcio", grpc.__version__, "numpy", np.__version__)
tensor = dmr.pack_tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
assert dmr.unpack_tensor(tensor).tolist() == [[0, 1, 2], [3, 4, 5]]
with dmr.serve(lambda settings: Catch(**settings)) as server:
    with dmr.connect(server.address, timeout=30) as conn:
        env, _ = dmr.create_and_join_world(conn, {"seed": 3}, {})
        timestep = env.reset()
        for _ in range(30):
            timestep = env.step({"paddle": 1})
        env.close()
print("ok")
"""


def _floors() -> list[str]:
    text = (ROOT / "setup.py").read_text()
    block = re.search(r"INSTALL_REQUIRES = \[(.*?)\]", text, re.S)
    assert block is not None
    pins = [req.replace(">=", "==") for req in re.findall(r'"([^"]+)"', block.group(1))]
    assert all("==" in pin for pin in pins), pins
    return pins


@pytest.mark.timeout(600)
def test_declared_floors_work(tmp_path: pathlib.Path) -> None:
    env_dir = tmp_path / "floor-venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    pins = _floors()
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", *pins],
        check=True,
        capture_output=True,
        text=True,
    )
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", str(ROOT)],
        check=True,
        capture_output=True,
        text=True,
    )
    result = subprocess.run(
        [str(python), "-c", textwrap.dedent(SMOKE)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    versions = result.stdout.splitlines()[0]
    for pin in pins:
        name, version = pin.split("==")
        if name in ("protobuf", "grpcio", "numpy"):
            assert f"{name} {version}" in versions, versions
    assert result.stdout.strip().endswith("ok")
