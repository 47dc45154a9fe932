"""The generated protobuf code: up to date, and wire-identical to the reference package."""

from __future__ import annotations

import filecmp
import importlib
import pathlib
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from google.protobuf import descriptor, descriptor_pb2

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "dm_env_rpc_client" / "_proto"

# (our module, the reference package's module)
PAIRS = [
    ("dm_env_rpc_client._proto.dm_env_rpc_pb2", "dm_env_rpc.v1.dm_env_rpc_pb2"),
    ("dm_env_rpc_client._proto.properties_pb2", "dm_env_rpc.v1.extensions.properties_pb2"),
]


def test_generated_code_is_up_to_date(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "_proto"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    generated = sorted(p.name for p in out.iterdir() if p.is_file())
    committed = sorted(
        p.name for p in COMMITTED.iterdir() if p.is_file() and p.suffix in (".py", ".pyi")
    )
    assert generated == committed, "run `python scripts/gen_protos.py` and commit the result"
    _, mismatch, errors = filecmp.cmpfiles(out, COMMITTED, generated, shallow=False)
    assert not mismatch and not errors, (
        f"stale generated files {mismatch + errors}: run `python scripts/gen_protos.py` and commit"
    )


def _field(field: descriptor.FieldDescriptor) -> dict[str, Any]:
    return {
        "full_name": field.full_name,
        "number": field.number,
        "type": field.type,
        "label": field.label,
        "message_type": field.message_type.full_name if field.message_type else None,
        "enum_type": field.enum_type.full_name if field.enum_type else None,
        "oneof": field.containing_oneof.name if field.containing_oneof else None,
    }


def _enum(enum: descriptor.EnumDescriptor) -> dict[str, Any]:
    return {"full_name": enum.full_name, "values": [(v.name, v.number) for v in enum.values]}


def _message(message: descriptor.Descriptor) -> dict[str, Any]:
    return {
        "full_name": message.full_name,
        "map_entry": message.GetOptions().map_entry,
        "fields": [_field(f) for f in message.fields],
        "oneofs": [(o.name, [f.name for f in o.fields]) for o in message.oneofs],
        "nested": [_message(m) for m in message.nested_types],
        "enums": [_enum(e) for e in message.enum_types],
    }


def _file(file: descriptor.FileDescriptor) -> dict[str, Any]:
    return {
        "name": file.name,
        "package": file.package,
        "dependencies": [d.name for d in file.dependencies],
        "messages": [_message(m) for m in file.message_types_by_name.values()],
        "enums": [_enum(e) for e in file.enum_types_by_name.values()],
        "services": [
            (
                s.full_name,
                [(m.name, m.input_type.full_name, m.output_type.full_name) for m in s.methods],
            )
            for s in file.services_by_name.values()
        ],
    }


@pytest.mark.parametrize(("ours", "theirs"), PAIRS)
def test_descriptors_equal_reference(ours: str, theirs: str) -> None:
    ours_file = importlib.import_module(ours).DESCRIPTOR
    theirs_file = importlib.import_module(theirs).DESCRIPTOR
    assert _file(ours_file) == _file(theirs_file)
    ours_proto, theirs_proto = (
        descriptor_pb2.FileDescriptorProto(),
        descriptor_pb2.FileDescriptorProto(),
    )
    ours_file.CopyToProto(ours_proto)
    theirs_file.CopyToProto(theirs_proto)
    assert ours_proto == theirs_proto
    assert ours_file.serialized_pb == theirs_file.serialized_pb


def test_every_wire_name_is_covered() -> None:
    from dm_env_rpc_client._proto import dm_env_rpc_pb2, properties_pb2

    described = _file(dm_env_rpc_pb2.DESCRIPTOR)
    names = {m["full_name"] for m in described["messages"]}
    assert "dm_env_rpc.v1.EnvironmentRequest" in names
    assert [s[0] for s in described["services"]] == ["dm_env_rpc.v1.Environment"]
    assert len(_file(properties_pb2.DESCRIPTOR)["messages"]) == 9


_ROUND_TRIP = """
import sys
{first}
{second}
from dm_env_rpc_client._proto import dm_env_rpc_pb2 as ours
from dm_env_rpc.v1 import dm_env_rpc_pb2 as theirs

def build(mod):
    request = mod.EnvironmentRequest()
    step = request.step
    step.actions[3].floats.array.extend([1.5, -2.0])
    step.actions[3].shape.extend([2])
    step.actions[7].strings.array.append("héllo")
    step.requested_observations.extend([1, 2, 99])
    return request

for a, b in ((ours, theirs), (theirs, ours)):
    data = build(a).SerializeToString(deterministic=True)
    parsed = b.EnvironmentRequest.FromString(data)
    assert parsed == build(b), parsed
    assert parsed.SerializeToString(deterministic=True) == data
print("ok")
"""


@pytest.mark.parametrize("ours_first", [True, False])
def test_coexists_with_reference_package(ours_first: bool) -> None:
    ours, theirs = "import dm_env_rpc_client", "from dm_env_rpc.v1 import dm_env_rpc_pb2"
    first, second = (ours, theirs) if ours_first else (theirs, ours)
    script = _ROUND_TRIP.format(first=first, second=second)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
