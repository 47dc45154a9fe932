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


# An integration whose extra is not installed may not import: a private helper with the
# third-party package's own ModuleNotFoundError, a public module only with an ImportError
# that names the extra (`pip install 'dm_env_rpc_client[...]'`). Anything else still fails.
OPTIONAL_EXTRA_MISSING = (
    "        except ImportError as exc:\n"
    "            missing = exc.name or getattr(exc.__cause__, 'name', None) or ''\n"
    "            module = m.name.rsplit('.', 1)[1]\n"
    "            if not (m.name.startswith('dm_env_rpc_client.integrations.') and missing\n"
    "                    and not missing.startswith('dm_env_rpc')\n"
    "                    and (module.startswith('_') or 'dm_env_rpc_client[' in str(exc))):\n"
    "                raise\n"
)


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
        "        try:\n"
        "            importlib.import_module(m.name)\n"
        f"{OPTIONAL_EXTRA_MISSING}"
        "print(sorted(n for n in sys.modules if n == 'dm_env_rpc' or n.startswith('dm_env_rpc.')))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_every_name_the_switch_table_lists_is_under_dmr() -> None:
    text = (ROOT / "docs" / "index.md").read_text()
    start = text.index("What they hold under the reference's names:")
    paragraph = text[start : text.index("\n\n", start)]
    assert "All of them are also under `dmr`" in paragraph
    names = {
        code.split("(")[0].rsplit(".", 1)[-1]
        for code in re.findall(r"`([^`]+)`", paragraph)
        if not code.endswith("=") and "dmr" not in code
    }
    names -= {"dm_env_rpc_connection", "connection"}  # the module, which is dmr.connection
    assert {"Metadata", "ConnectionType", "DmEnvAdaptor", "PropertiesExtension"} <= names
    missing = sorted(name for name in names if name not in dmr.__all__)
    assert missing == []
    assert "`dm_env_rpc_connection`, which is `dmr.connection`" in paragraph
