"""Peak client memory while receiving one large answer, good or with a payload that lies.

Three servers, each in a process of its own, answer a step with one float32
observation of ``--megabytes`` MB:

- ``raw answering server``: a bare gRPC server that answers every step with
  pre-built bytes, ``good`` (its payload fits its declared shape) or ``bad``
  (the declared shape is the spec's, the payload one element short: only a
  faulty server sends that, so only this server has the ``bad`` rows);
- ``SDK server``: the SDK's own embedded server serving ``--env large``;
- ``reference-package server``: the foreign server written on the reference
  ``dm-env-rpc`` package (``_lib/foreign_server.py --env large``).

Each client variant runs in a fresh process, which reads its resident memory
before the answer (``VmRSS``) and its peak after (``VmHWM``); the table gives
the peak's growth over the answer's size B (for the batch, B is the four
answers together), against each server:

- ``raw gRPC floor``: a bare gRPC stream receiving the answer's bytes, then
  copying the payload into an array (what any client must hold: the bytes and
  the array);
- ``SDK lockstep``: ``DmEnvAdaptor.reset()`` (whose first step gets the answer);
- ``raw gRPC asyncio floor, 4 streams``: four bare ``grpc.aio`` streams on one
  channel (as a batch has them) each receiving an answer at once, then each
  payload copied into a ``[4, n]`` array;
- ``SDK batch of 4``: ``BatchedEnvironment.reset()`` on four worlds.

The ``/ floor`` column compares each SDK row with the floor above it, on the
same server. The floors find the float payload in the answer's bytes by walking
its protobuf fields (``_payload``), without decoding them.

Run: ``python bench/answer_memory.py [--megabytes 64]``. Numbers on a shared
machine drift little here (memory, not time), but other processes do not count.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import queue
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc  # noqa: E402
from _lib.common import (  # noqa: E402
    SERVERS,
    ServerInfo,
    foreign_server_process_info,
    server_process_info,
)

from dm_env_rpc_client._codec.payload import _read_varint  # noqa: E402
from dm_env_rpc_client._proto import dm_env_rpc_pb2  # noqa: E402

METHOD = "/dm_env_rpc.v1.Environment/Process"
VARIANTS = ("raw gRPC floor", "SDK lockstep", "raw gRPC asyncio floor, 4 streams", "SDK batch of 4")
RAW_SERVER = "raw answering server"
LEN = 2  # protobuf's length-delimited wire type
_FLOATS = (3, 2, 2, 1, 1)  # the field numbers down to a step answer's float payloads (_payload)


def _status_kb(field: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _answers(elements: int, mode: str) -> tuple[bytes, bytes, bytes]:
    """The create, join and step answers' bytes (the step answer made once)."""
    spec = dm_env_rpc_pb2.TensorSpec(name="big", shape=[elements], dtype=dm_env_rpc_pb2.FLOAT)
    specs = dm_env_rpc_pb2.ActionObservationSpecs(observations={1: spec})
    create = dm_env_rpc_pb2.EnvironmentResponse(create_world={"world_name": "w"})
    join = dm_env_rpc_pb2.EnvironmentResponse(join_world={"specs": specs})
    payload = elements if mode == "good" else elements - 1
    body = bytes(4 * payload)
    # Tensor{floats{array: packed body}, shape}: built by hand, so the server holds one copy.
    packed = b"\x0a" + _varint(len(body)) + body
    tensor_bytes = b"\x0a" + _varint(len(packed)) + packed + b"\x7a" + _varint_list([elements])
    entry = b"\x08\x01\x12" + _varint(len(tensor_bytes)) + tensor_bytes
    step = b"\x08\x01\x12" + _varint(len(entry)) + entry  # state RUNNING, observations{1: ...}
    response = b"\x1a" + _varint(len(step)) + step
    return create.SerializeToString(), join.SerializeToString(), response


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _varint_list(values: list[int]) -> bytes:
    body = b"".join(_varint(v) for v in values)
    return _varint(len(body)) + body


def _fields(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """The length-delimited fields of the message in ``data[start:end]``: ``(number, at, end)``."""
    position = start
    while position < end:
        key, position = _read_varint(data, position)
        wire = key & 7
        if wire == 0:
            _, position = _read_varint(data, position)
        elif wire in (1, 5):
            position += 8 if wire == 1 else 4
        elif wire == LEN:
            length, position = _read_varint(data, position)
            yield key >> 3, position, position + length
            position += length
        else:
            raise ValueError(f"wire type {wire} in an answer")


def _payload(data: bytes) -> tuple[int, int]:
    """``(offset, count)`` of the largest float32 payload of a step answer's bytes.

    Its fields, outermost first (``_FLOATS``): EnvironmentResponse.step (3) ->
    StepResponse.observations (2, map entries) -> entry value (2, Tensor) ->
    Tensor.floats (1, FloatArray) -> array (1, packed).
    """
    spans = [(0, len(data))]
    for number in _FLOATS:
        spans = [
            (at, end)
            for start, stop in spans
            for field, at, end in _fields(data, start, stop)
            if field == number
        ]
    at, end = max(spans, key=lambda span: span[1] - span[0], default=(0, 0))
    return at, (end - at) // 4


def _step_request(join_answer: bytes) -> Any:
    """A StepRequest asking for every observation the JoinWorld answer names."""
    specs = dm_env_rpc_pb2.EnvironmentResponse.FromString(join_answer).join_world.specs
    step = dm_env_rpc_pb2.StepRequest(requested_observations=sorted(specs.observations))
    return dm_env_rpc_pb2.EnvironmentRequest(step=step)


def serve(port_file: str, elements: int, mode: str) -> None:
    """The server process: answers every stream; writes its port to ``port_file``."""
    create, join, step = _answers(elements, mode)
    check = dm_env_rpc_pb2.EnvironmentResponse.FromString(step)
    assert len(check.step.observations[1].floats.array) in (elements, elements - 1)
    del check
    specs = dm_env_rpc_pb2.JoinWorldResponse.FromString(
        dm_env_rpc_pb2.EnvironmentResponse.FromString(join).join_world.SerializeToString()
    ).specs
    reset = dm_env_rpc_pb2.EnvironmentResponse(reset={"specs": specs}).SerializeToString()
    answers = {"create_world": create, "join_world": join, "step": step, "reset": reset}

    def process(requests: Iterator[Any], context: Any) -> Iterator[bytes]:
        for request in requests:
            kind = request.WhichOneof("payload")
            if kind not in answers:
                other = dm_env_rpc_pb2.EnvironmentResponse()
                getattr(other, kind).SetInParent()
                answers[kind] = other.SerializeToString()
            yield answers[kind]

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)],
    )
    handler = grpc.stream_stream_rpc_method_handler(
        process,
        request_deserializer=dm_env_rpc_pb2.EnvironmentRequest.FromString,
        response_serializer=lambda data: data,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("dm_env_rpc.v1.Environment", {"Process": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    pathlib.Path(port_file).write_text(str(port))
    server.wait_for_termination()


def client(variant: str, address: str, elements: int) -> None:
    """One measurement in this fresh process; prints ``before_kb peak_kb outcome``."""
    import numpy as np

    import dm_env_rpc_client as dmr

    outcome = "ok"
    if variant == "raw gRPC floor":
        channel = grpc.insecure_channel(address, [("grpc.max_receive_message_length", -1)])
        requests: queue.Queue[Any] = queue.Queue()
        call = channel.stream_stream(
            METHOD, request_serializer=dm_env_rpc_pb2.EnvironmentRequest.SerializeToString
        )
        responses = call(iter(requests.get, None))
        requests.put(dm_env_rpc_pb2.EnvironmentRequest(create_world={}))
        world = dm_env_rpc_pb2.EnvironmentResponse.FromString(next(responses))
        name = world.create_world.world_name
        requests.put(dm_env_rpc_pb2.EnvironmentRequest(join_world={"world_name": name}))
        step = _step_request(next(responses))
        before = _status_kb("VmRSS")
        requests.put(step)
        data = next(responses)
        offset, count = _payload(data)
        array = np.frombuffer(data, np.float32, count, offset).copy()
        del array, data
        requests.put(None)
        channel.close()
    elif variant.startswith("raw gRPC asyncio"):
        import asyncio

        async def four() -> int:
            options = [("grpc.max_receive_message_length", -1)]
            async with grpc.aio.insecure_channel(address, options) as channel:
                calls = []
                for _ in range(4):
                    call = channel.stream_stream(
                        METHOD,
                        request_serializer=dm_env_rpc_pb2.EnvironmentRequest.SerializeToString,
                    )()
                    await call.write(dm_env_rpc_pb2.EnvironmentRequest(create_world={}))
                    world = dm_env_rpc_pb2.EnvironmentResponse.FromString(await call.read())
                    name = world.create_world.world_name
                    await call.write(
                        dm_env_rpc_pb2.EnvironmentRequest(join_world={"world_name": name})
                    )
                    calls.append((call, _step_request(await call.read())))
                start = _status_kb("VmRSS")
                for call, step in calls:
                    await call.write(step)
                answers = await asyncio.gather(*(call.read() for call, _ in calls))
                out = np.empty((4, elements), np.float32)
                for row, data in zip(out, answers, strict=True):
                    offset, count = _payload(data)
                    row[:count] = np.frombuffer(data, np.float32, count, offset)
                del answers, out
                for call, _ in calls:
                    call.cancel()
                return start

        before = asyncio.run(four())
    elif variant == "SDK lockstep":
        with dmr.connect(address, timeout=60) as conn:
            env, _ = dmr.create_and_join_world(conn, {}, {}, timeout=60)
            before = _status_kb("VmRSS")
            try:
                env.reset()
            except dmr.ObservationError as exc:
                outcome = f"refused: {type(exc).__name__}"
    else:
        with dmr.BatchedEnvironment.connect(address, 4, timeout=60, seed_setting=None) as batch:
            before = _status_kb("VmRSS")
            try:
                batch.reset()
            except dmr.DmEnvRpcClientError as exc:
                outcome = f"refused: {type(exc).__name__}"
    print(before, _status_kb("VmHWM"), outcome)


@contextlib.contextmanager
def server_process(elements: int, mode: str) -> Iterator[ServerInfo]:
    with tempfile.TemporaryDirectory() as folder:
        port_file = pathlib.Path(folder, "port")
        command = [sys.executable, __file__, "--serve", str(port_file), "--mode", mode]
        process = subprocess.Popen([*command, "--elements", str(elements)])
        try:
            deadline = time.monotonic() + 60
            while not port_file.exists() or not port_file.read_text():
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("the answer server did not start")
                time.sleep(0.05)
            yield ServerInfo(f"127.0.0.1:{port_file.read_text()}", process.pid)
        finally:
            process.kill()
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=64.0, help="one answer's size")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="good", help=argparse.SUPPRESS)
    parser.add_argument("--elements", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.elements, args.mode)
        return
    if args.client:
        client(args.client, args.address, args.elements)
        return
    elements = int(args.megabytes * 1e6) // 4
    answer_mb = 4 * elements / 1e6
    print(f"one answer: float32[{elements}], B = {answer_mb:.1f} MB (the batch: 4 answers)\n")
    print("| server | answer | client | peak growth MB | / B | / floor | outcome |")
    print("|---|---|---|---:|---:|---:|---|")
    size = ("--size", str(elements))
    servers = [
        (RAW_SERVER, "good", lambda: server_process(elements, "good")),
        (SERVERS["sdk"], "good", lambda: server_process_info("large", *size)),
        (SERVERS["foreign"], "good", lambda: foreign_server_process_info("large", *size)),
        (RAW_SERVER, "bad", lambda: server_process(elements, "bad")),
    ]
    for server, mode, start in servers:
        with start() as info:
            floor = None
            for variant in VARIANTS:
                row = _measure(variant, info.address, elements, answer_mb)
                if isinstance(row, str):
                    print(f"| {server} | {mode} | {variant} | failed: {row} |")
                    continue
                ratio, growth, outcome = row
                if variant.startswith("raw"):
                    floor = ratio
                versus = "" if floor is None else f"{ratio / floor:.2f}x"
                print(
                    f"| {server} | {mode} | {variant} | {growth:,.0f} | {ratio:.2f} | {versus} | "
                    f"{outcome} |"
                )


def _measure(
    variant: str, address: str, elements: int, answer_mb: float
) -> tuple[float, float, str] | str:
    """``(peak growth / B, peak growth MB, outcome)`` of one client process, or why it failed."""
    command = [sys.executable, __file__, "--client", variant, "--address", address]
    done = subprocess.run(
        [*command, "--elements", str(elements)], capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        return done.stderr.strip()[-200:]
    before, peak, *outcome = done.stdout.split()
    growth = (int(peak) - int(before)) / 1e3
    size = answer_mb * (4 if "4" in variant else 1)
    return growth / size, growth, " ".join(outcome)


if __name__ == "__main__":
    main()
