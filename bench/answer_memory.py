"""Peak client memory while receiving one large answer, good or with a payload that lies.

A raw gRPC server process answers every step with one float32 observation of
``--megabytes`` MB: ``good`` (its payload fits its declared shape) or ``bad``
(the declared shape is the spec's, the payload one element short). Each client
variant runs in a fresh process, which reads its resident memory before the
answer (``VmRSS``) and its peak after (``VmHWM``); the table gives the peak's
growth over the answer's size B (for the batch, B is the four answers together):

- ``raw gRPC floor``: a bare gRPC stream receiving the answer's bytes, then
  copying the payload into an array (what any client must hold: the bytes and
  the array);
- ``SDK lockstep``: ``DmEnvAdaptor.reset()`` (whose first step gets the answer);
- ``raw gRPC asyncio floor, 4 streams``: four bare ``grpc.aio`` streams on one
  channel (as a batch has them) each receiving an answer at once, then each
  payload copied into a ``[4, n]`` array;
- ``SDK batch of 4``: ``BatchedEnvironment.reset()`` on four worlds.

The ``/ floor`` column compares each SDK row with the floor above it.

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

from dm_env_rpc_client._proto import dm_env_rpc_pb2  # noqa: E402

METHOD = "/dm_env_rpc.v1.Environment/Process"
VARIANTS = ("raw gRPC floor", "SDK lockstep", "raw gRPC asyncio floor, 4 streams", "SDK batch of 4")


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
        for payload in ({"create_world": {}}, {"join_world": {"world_name": "w"}}):
            requests.put(dm_env_rpc_pb2.EnvironmentRequest(**payload))
            next(responses)
        before = _status_kb("VmRSS")
        requests.put(dm_env_rpc_pb2.EnvironmentRequest(step={}))
        data = next(responses)
        array = np.frombuffer(data, np.float32, elements, len(data) - 4 * elements - 4).copy()
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
                    for payload in ({"create_world": {}}, {"join_world": {"world_name": "w"}}):
                        await call.write(dm_env_rpc_pb2.EnvironmentRequest(**payload))
                        await call.read()
                    calls.append(call)
                start = _status_kb("VmRSS")
                for call in calls:
                    await call.write(dm_env_rpc_pb2.EnvironmentRequest(step={}))
                answers = await asyncio.gather(*(call.read() for call in calls))
                out = np.empty((4, elements), np.float32)
                for row, data in zip(out, answers, strict=True):
                    row[...] = np.frombuffer(
                        data, np.float32, elements, len(data) - 4 * elements - 4
                    )
                del answers, out
                for call in calls:
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
def server_process(elements: int, mode: str) -> Iterator[str]:
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
            yield f"127.0.0.1:{port_file.read_text()}"
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
    print("| answer | client | peak growth MB | / B | / floor | outcome |")
    print("|---|---|---:|---:|---:|---|")
    for mode in ("good", "bad"):
        with server_process(elements, mode) as address:
            floor = None
            for variant in VARIANTS:
                command = [sys.executable, __file__, "--client", variant, "--address", address]
                done = subprocess.run(
                    [*command, "--elements", str(elements)],
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
                if done.returncode != 0:
                    print(f"| {mode} | {variant} | failed: {done.stderr.strip()[-200:]} |")
                    continue
                before, peak, *outcome = done.stdout.split()
                growth = (int(peak) - int(before)) / 1e3
                size = answer_mb * (4 if "4" in variant else 1)
                if variant.startswith("raw"):
                    floor = growth / size
                ratio = growth / size
                versus = "" if floor is None else f"{ratio / floor:.2f}x"
                if variant.startswith("raw"):
                    versus = "1.00x"
                print(
                    f"| {mode} | {variant} | {growth:,.0f} | {ratio:.2f} | {versus} | "
                    f"{' '.join(outcome)} |"
                )


if __name__ == "__main__":
    main()
