"""The curated public face: a sorted __all__ of names that resolve, and no reference import."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import dm_env_rpc_client as dmr

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_all_is_sorted_unique_and_resolves() -> None:
    assert list(dmr.__all__) == sorted(set(dmr.__all__))
    for name in dmr.__all__:
        assert getattr(dmr, name) is not None, name


def test_public_names_of_design_doc() -> None:
    for name in (
        "connect",
        "connect_async",
        "Connection",
        "AsyncConnection",
        "DmEnvAdaptor",
        "create_and_join_world",
        "DmEnvRpcError",
        "pack_tensor",
        "unpack_tensor",
        "SpecManager",
        "serve",
        "dm_env_rpc_pb2",
    ):
        assert name in dmr.__all__, name


def test_library_never_imports_the_reference_package() -> None:
    pattern = re.compile(r"^\s*(from|import)\s+dm_env_rpc(\.|\s)", re.M)
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "dm_env_rpc_client").rglob("*.py")
        if pattern.search(path.read_text())
    ]
    assert offenders == []
    script = (
        "import pkgutil, importlib, sys, dm_env_rpc_client as d\n"
        "for m in pkgutil.walk_packages(d.__path__, 'dm_env_rpc_client.'):\n"
        "    if not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
        "print(sorted(n for n in sys.modules if n == 'dm_env_rpc' or n.startswith('dm_env_rpc.')))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
