#!/usr/bin/env python3
"""Generate ``dm_env_rpc_client/_proto`` from ``protos/``: the one way to do it.

Runs ``grpc_tools.protoc`` (with the mypy-protobuf plugins for the ``.pyi``
stubs) on the two dm_env_rpc proto files, then moves the output into a flat
``dm_env_rpc_client/_proto`` package and rewrites the generated imports from the
proto package path (``dm_env_rpc.v1...``) to ours. The proto *file* names and
packages stay those of the wire contract, so descriptors match every other
dm_env_rpc implementation.

Usage::

    python scripts/gen_protos.py               # regenerate in place
    python scripts/gen_protos.py --out DIR     # write the package into DIR

The exact versions of grpcio-tools and mypy-protobuf are pinned in the ``test``
extra; a test regenerates into a temporary folder and compares.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
DEFAULT_OUT = ROOT / "dm_env_rpc_client" / "_proto"
PACKAGE = "dm_env_rpc_client._proto"

# (proto path relative to protos/, generated module stem)
PROTOS = (
    ("dm_env_rpc/v1/dm_env_rpc.proto", "dm_env_rpc"),
    ("dm_env_rpc/v1/extensions/properties.proto", "properties"),
)

# Generated module paths (as protoc names them) -> our module paths.
_MODULE_MAP = {
    "dm_env_rpc.v1.dm_env_rpc_pb2": f"{PACKAGE}.dm_env_rpc_pb2",
    "dm_env_rpc.v1.dm_env_rpc_pb2_grpc": f"{PACKAGE}.dm_env_rpc_pb2_grpc",
    "dm_env_rpc.v1.extensions.properties_pb2": f"{PACKAGE}.properties_pb2",
}

_INIT = '''"""Generated protobuf modules for dm_env_rpc v1. Do not edit.

Produced by ``scripts/gen_protos.py`` from ``protos/``.
"""
'''


def _include_dirs() -> list[str]:
    import grpc_tools

    dirs = [str(PROTO_ROOT), str(pathlib.Path(grpc_tools.__file__).parent / "_proto")]
    # google/rpc/status.proto ships inside googleapis-common-protos; find it
    # without importing (its generated module may need a newer runtime).
    import importlib.util

    spec = importlib.util.find_spec("google.rpc")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (pathlib.Path(location) / "status.proto").exists():
            dirs.append(str(pathlib.Path(location).parent.parent))
            break
    else:
        raise SystemExit("google/rpc/status.proto not found: install googleapis-common-protos.")
    return dirs


def _plugin(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(pathlib.Path(sys.executable).parent))
    if found is None:
        raise SystemExit(f"{name} not found: install the test extra (pip install -e '.[test]').")
    return found


def _rewrite(text: str) -> str:
    for old, new in _MODULE_MAP.items():
        old_pkg, _, old_mod = old.rpartition(".")
        new_pkg, _, new_mod = new.rpartition(".")
        # "from dm_env_rpc.v1 import dm_env_rpc_pb2 as ..."
        text = re.sub(
            rf"\bfrom {re.escape(old_pkg)} import {old_mod}\b",
            f"from {new_pkg} import {new_mod}",
            text,
        )
        # "import dm_env_rpc.v1.dm_env_rpc_pb2" (mypy stubs) and module-name strings.
        text = re.sub(rf"(?<![\w.]){re.escape(old)}(?![\w])", new, text)
    return text


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Generates the package into ``out_dir``; returns the files written."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            *(f"-I{d}" for d in _include_dirs()),
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
            f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
            f"--mypy_out={tmp}",
            f"--mypy_grpc_out={tmp}",
            *(proto for proto, _ in PROTOS),
        ]
        cwd = os.getcwd()
        os.chdir(PROTO_ROOT)
        try:
            if protoc.main(args) != 0:
                raise SystemExit("protoc failed")
        finally:
            os.chdir(cwd)

        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for proto, stem in PROTOS:
            src_dir = pathlib.Path(tmp) / pathlib.Path(proto).parent
            for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi"):
                src = src_dir / f"{stem}{suffix}"
                if not src.exists():
                    continue
                text = _rewrite(src.read_text())
                has_service = "\nservice " in (PROTO_ROOT / proto).read_text()
                if suffix.startswith("_pb2_grpc") and not has_service:
                    continue  # no services in this file: skip the empty grpc module
                dest = out_dir / src.name
                dest.write_text(text)
                written.append(dest)
        init = out_dir / "__init__.py"
        init.write_text(_INIT)
        written.append(init)
    return sorted(written)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
