"""Multi-agent worlds: agent-steps per second and client CPU per agent-step, 2 to 8 agents per
world, 1 to 256 worlds, the SDK against the reference client and a raw gRPC floor.

Run: ``python bench/multiagent.py [--agents 2 4 8] [--worlds 1 4 16 64 256] [--rounds R]
[--steps N] [--servers lockstep foreign]``.

The server (``--servers``):

- ``lockstep``: a bare ``grpc.aio`` server with a real barrier per world and pre-serialized
  answers (``_lib/lockstep_server.py``), so that the clients, not the server, are measured;
- ``foreign``: the multi-agent Paddles server written on the reference package
  (``tests/ma_foreign_server.py``: a sync gRPC servicer, one thread per stream, the lockstep
  step blocked on a ``threading.Condition``), as most multi-agent servers in the wild are;
  it is slow, so its table is a check that the SDK's route works there, not a measure of it;
- ``sdk``: the SDK's own server serving its Paddles game (``--game paddles``).

Clients, each driving every agent of every world, one step per agent per round:

- SDK ``step_agents``: ``dmr.MultiAgentBatch``, every agent's step written at once on one
  event loop, each round's steps received together;
- SDK ``send/recv``: the same batch as a flat batch of agent slots, each agent sent its next
  step as soon as its last one is received (one in flight per agent, a policy's shape);
- SDK ``collect``: ``dmr.collect(batch, steps, seed=...)`` on the same batch, random actions
  drawn per agent-step, ``DEFAULT_PIPELINE`` (8) world steps in flight per world, a world's
  agents always sent their steps together: what a user's random-action stepping runs;
- reference: the reference package's client, one ``DmEnvAdaptor`` per agent, a thread per
  agent, and a barrier per world between rounds (stepping agents from one thread deadlocks);
  skipped above ``--max-threads`` agents;
- raw floor: bare ``grpc.aio`` streams on one event loop, one channel per server, writing a
  pre-serialized step request and reading undecoded answers, one in flight per stream;
- raw floor, 8 in flight: the same with ``collect``'s pipeline depth (8 steps written ahead
  per stream), the floor ``collect``'s CPU is compared with (the others' is the one above).

The variants of a cell are interleaved in rounds (``_lib.common.measure_interleaved``); steps/s
and CPU are medians over the rounds, ratios medians of per-round ratios. The servers and the
client are pinned to separate CPUs (``--no-pin`` shares them). The machine is shared: numbers
drift between runs, ratios taken in one run less so.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys
import threading
from typing import Any

# _lib.common first: it sets GRPC_VERBOSITY before grpc is imported.
from _lib.common import (
    add_pin_argument,
    apply_pin,
    command_server_process_info,
    measure_interleaved,
    print_table,
)

# isort: split
import grpc
import numpy as np
from _lib.floors import step_request
from dm_env_rpc.v1 import connection as reference_connection
from dm_env_rpc.v1 import dm_env_adaptor as reference_adaptor

import dm_env_rpc_client as dmr
from dm_env_rpc_client import dm_env_rpc_pb2
from dm_env_rpc_client.messages import METHOD
from dm_env_rpc_client.server.paddles import MAX_AGENTS as PADDLES_MAX_AGENTS
from dm_env_rpc_client.stepping import DEFAULT_PIPELINE

HERE = pathlib.Path(__file__).resolve().parent
SERVER_COMMANDS = {
    "lockstep": [sys.executable, str(HERE / "_lib" / "lockstep_server.py"), "--exit-with-parent"],
    "foreign": [
        sys.executable,
        str(HERE.parent / "tests" / "ma_foreign_server.py"),
        "--max-workers",
        "2200",
    ],
}
SERVER_COMMANDS["sdk"] = [
    sys.executable,
    "-m",
    "dm_env_rpc_client.server",
    "--game",
    "paddles",
    "--port",
    "0",
    "--max-workers",  # one stream a world's agent: 2,048 at 256 worlds x 8 agents
    "2200",
    "--exit-with-parent",
]
# The most agents a world of each server takes (Paddles: 2 to 4; the foreign server's game: 1
# to 8); a cell with more prints "-" rows for that server.
SERVER_MAX_AGENTS = {"lockstep": None, "foreign": 8, "sdk": PADDLES_MAX_AGENTS}
SERVER_NAMES = {
    "lockstep": "grpc.aio lockstep",
    "foreign": "reference-package Paddles",
    "sdk": "SDK Paddles",
}
OURS, OURS_FLAT, OURS_COLLECT = "SDK step_agents", "SDK send/recv", "SDK collect, 8 in flight"
REFERENCE, FLOOR = "reference, thread/agent", "raw gRPC floor"
FLOOR_PIPELINED = "raw gRPC floor, 8 in flight"
PIPELINE = DEFAULT_PIPELINE
ORDER = (OURS, OURS_FLAT, OURS_COLLECT, REFERENCE, FLOOR, FLOOR_PIPELINED)
# --clients' names for the clients (each row's ratios need the reference and its floor: a
# ratio whose base was not run prints "-").
CLIENTS = {
    "step_agents": OURS,
    "send_recv": OURS_FLAT,
    "collect": OURS_COLLECT,
    "reference": REFERENCE,
    "floor": FLOOR,
    "floor8": FLOOR_PIPELINED,
}


def _settings(agents: int) -> dict[str, Any]:
    return {"num_agents": agents}


def ours(address: str, worlds: int, agents: int) -> Any:
    batch = dmr.MultiAgentBatch.connect(
        address, worlds, agents, create_world_settings=_settings(agents), timeout=60
    )
    batch.reset_agents()
    actions = {name: {"paddle": np.zeros(worlds, np.int8)} for name in batch.agents}

    def run(steps: int) -> None:
        for _ in range(steps // (worlds * agents)):
            batch.step_agents(actions, timeout=60)

    return run, batch.close


def ours_flat(address: str, worlds: int, agents: int) -> Any:
    batch = dmr.MultiAgentBatch.connect(
        address, worlds, agents, create_world_settings=_settings(agents), timeout=60
    )
    batch.reset_agents()
    slots = worlds * agents
    zeros = np.zeros(slots, np.int8)

    def run(steps: int) -> None:
        quota = steps // slots  # every agent the same number: a lockstep world waits for all
        sent = np.ones(slots, np.int64)
        batch.send({"paddle": zeros}, list(range(slots)))
        received = 0
        while received < quota * slots:
            done = batch.recv(1, timeout=60)  # all that landed: a lockstep world waits for the rest
            received += len(done.env_ids)
            ids = [slot for slot in done.env_ids.tolist() if sent[slot] < quota]
            if ids:
                batch.send({"paddle": zeros[: len(ids)]}, ids)
                sent[ids] += 1

    return run, batch.close


def ours_collect(address: str, worlds: int, agents: int) -> Any:
    batch = dmr.MultiAgentBatch.connect(
        address, worlds, agents, create_world_settings=_settings(agents), timeout=60
    )
    batch.reset_agents()
    seeds = iter(range(1, 1 << 30))

    def run(steps: int) -> None:
        stats = dmr.collect(batch, steps, seed=next(seeds), timeout=60, pipeline=PIPELINE)
        assert stats.steps >= steps, (stats.steps, steps)

    return run, batch.close


def reference_threads(address: str, worlds: int, agents: int) -> Any:
    channels, conns, envs = [], [], []
    for _ in range(worlds):
        world_envs = []
        for agent in range(agents):
            channel = grpc.insecure_channel(address)
            conn = reference_connection.Connection(channel)
            if agent == 0:
                name = reference_adaptor.create_world(conn, _settings(agents))
            world_envs.append(reference_adaptor.join_world(conn, name, {}))
            channels.append(channel)
            conns.append(conn)
        envs.append(world_envs)
    barriers = [threading.Barrier(agents) for _ in range(worlds)]

    def in_threads(work: Any) -> None:
        threads = [
            threading.Thread(target=work, args=(env, barriers[w]))
            for w in range(worlds)
            for env in envs[w]
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    in_threads(lambda env, barrier: env.reset())  # every agent's FIRST step at once

    def run(steps: int) -> None:
        rounds = steps // (worlds * agents)

        def agent_loop(env: Any, barrier: threading.Barrier) -> None:
            for _ in range(rounds):
                env.step({"paddle": np.int8(0)})
                barrier.wait()

        in_threads(agent_loop)

    def close() -> None:
        for world_envs in envs:
            for env in world_envs:
                env._connection.send(reference_adaptor.dm_env_rpc_pb2.LeaveWorldRequest())
        for conn, channel in zip(conns, channels, strict=True):
            conn.close()
            channel.close()

    return run, close


_LOOP = asyncio.new_event_loop()  # one loop for every floor run: grpc.aio binds to it


def raw_floor(address: str, worlds: int, agents: int, depth: int = 1) -> Any:
    """One bare stream per agent on one event loop and one channel; a world is created on its
    first agent's stream and joined on each. ``depth`` steps are written ahead per stream."""
    loop = _LOOP
    Request, Response = dm_env_rpc_pb2.EnvironmentRequest, dm_env_rpc_pb2.EnvironmentResponse

    async def ask(call: Any, **payload: Any) -> Any:
        await call.write(Request(**payload).SerializeToString())
        return Response.FromString(await call.read())

    names: list[str] = []

    async def open_streams() -> tuple[Any, list[Any], bytes]:
        channel = grpc.aio.insecure_channel(address)
        calls, specs = [], None
        for _ in range(worlds):
            world_calls = [channel.stream_stream(METHOD)() for _ in range(agents)]
            settings = {"num_agents": dmr.pack_tensor(agents)}
            created = await ask(
                world_calls[0], create_world=dm_env_rpc_pb2.CreateWorldRequest(settings=settings)
            )
            name = created.create_world.world_name
            names.append(name)
            for call in world_calls:
                join = dm_env_rpc_pb2.JoinWorldRequest(world_name=name)
                specs = (await ask(call, join_world=join)).join_world.specs
            calls += world_calls
        assert specs is not None
        request = step_request(specs)
        paddle = dm_env_rpc_pb2.Tensor(int8s=dm_env_rpc_pb2.Tensor.Int8Array(array=b"\x00"))
        request.actions[min(specs.actions)].CopyFrom(paddle)
        return channel, calls, Request(step=request).SerializeToString()

    channel, calls, data = loop.run_until_complete(open_streams())

    async def stream(call: Any, rounds: int) -> None:
        ahead = min(depth, rounds)
        for _ in range(ahead):
            await call.write(data)
        for done in range(rounds):
            await call.read()  # undecoded bytes
            if done + ahead < rounds:
                await call.write(data)

    def run(steps: int) -> None:
        rounds = steps // (worlds * agents)

        async def all_streams() -> None:
            await asyncio.gather(*(stream(call, rounds) for call in calls))

        loop.run_until_complete(all_streams())

    run(worlds * agents)  # every agent's first step

    def close() -> None:
        async def leave(call: Any) -> None:
            await ask(call, leave_world=dm_env_rpc_pb2.LeaveWorldRequest())

        async def shut() -> None:
            # As a client should: every agent leaves, then each world is destroyed (from its
            # first agent's stream, no longer joined). A world left joined on a Paddles server
            # slowed the next runs' 1-deep floor there several times over.
            await asyncio.gather(*(leave(call) for call in calls))
            for world, name in enumerate(names):
                destroy = dm_env_rpc_pb2.DestroyWorldRequest(world_name=name)
                await ask(calls[world * agents], destroy_world=destroy)
            for call in calls:
                call.cancel()
            await channel.close()
            current = asyncio.current_task()
            leftover = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
            for task in leftover:
                task.cancel()
            await asyncio.gather(*leftover, return_exceptions=True)

        loop.run_until_complete(shut())

    return run, close


def _ratio(
    results: Any, variants: Any, name: str, base: str, field: str = "steps_per_second"
) -> str:
    """``name``'s median ratio to ``base`` in ``field``, or "-" if either was not run."""
    if name not in variants or base not in variants:
        return "-"
    return f"{results.ratio(name, base, field):.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--steps", type=int, default=8000, help="agent-steps per timed run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-threads", type=int, default=512)
    parser.add_argument("--servers", nargs="+", choices=list(SERVER_COMMANDS), default=["lockstep"])
    parser.add_argument("--clients", nargs="+", choices=list(CLIENTS), default=list(CLIENTS))
    add_pin_argument(parser)
    args = parser.parse_args()
    pinned = apply_pin(args.pin)
    chosen = {CLIENTS[key] for key in args.clients}
    rows = []
    try:  # the rows measured so far are printed even if a cell fails
        for server_key in args.servers:
            with command_server_process_info(SERVER_COMMANDS[server_key], server_key) as server:
                for agents in args.agents:
                    for worlds in args.worlds:
                        slots = worlds * agents
                        most = SERVER_MAX_AGENTS[server_key]
                        if most is not None and agents > most:
                            for name in [name for name in ORDER if name in chosen]:
                                rows.append(
                                    [SERVER_NAMES[server_key], agents, worlds, name] + ["-"] * 6
                                )
                            print(f"skipped: {server_key} takes at most {most} agents a world")
                            continue
                        steps = max(args.steps, slots * 4 * PIPELINE)
                        cell = {
                            "address": server.address,
                            "worlds": worlds,
                            "agents": agents,
                        }
                        variants = {
                            OURS: lambda cell=cell: ours(**cell),
                            OURS_FLAT: lambda cell=cell: ours_flat(**cell),
                            OURS_COLLECT: lambda cell=cell: ours_collect(**cell),
                            FLOOR: lambda cell=cell: raw_floor(**cell),
                            FLOOR_PIPELINED: lambda cell=cell: raw_floor(**cell, depth=PIPELINE),
                        }
                        if slots <= args.max_threads:
                            variants[REFERENCE] = lambda cell=cell: reference_threads(**cell)
                        variants = {name: make for name, make in variants.items() if name in chosen}
                        results = measure_interleaved(
                            variants,
                            steps,
                            rounds=args.rounds,
                            warmup=slots * 2,
                            server_pid=server.pid,
                        )
                        for name in [name for name in ORDER if name in chosen]:
                            if name not in variants:  # the reference, above --max-threads
                                rows.append(
                                    [SERVER_NAMES[server_key], agents, worlds, name] + ["-"] * 6
                                )
                                continue
                            floor = (
                                FLOOR_PIPELINED
                                if name in (OURS_COLLECT, FLOOR_PIPELINED)
                                else FLOOR
                            )
                            vs_reference = _ratio(results, variants, name, REFERENCE)
                            floor_vs_reference = _ratio(results, variants, floor, REFERENCE)
                            rows.append(
                                [
                                    SERVER_NAMES[server_key],
                                    agents,
                                    worlds,
                                    name,
                                    results.median(name),
                                    results.median(name, "cpu_us_per_step"),
                                    results.median(name, "server_cpu_us_per_step"),
                                    vs_reference,
                                    floor_vs_reference,
                                    _ratio(results, variants, name, floor, "cpu_us_per_step"),
                                ]
                            )
                        print(f"done: {server_key}, {agents} agents x {worlds} worlds", flush=True)
    finally:
        print_table(
            "Multi-agent worlds: agent-steps/s and client CPU per agent-step",
            [
                "server",
                "agents/world",
                "worlds",
                "client",
                "agent-steps/s",
                "client CPU µs/agent-step",
                "server CPU µs/agent-step",
                "steps/s vs reference",
                "its floor's steps/s vs reference",
                "CPU vs floor",
            ],
            rows,
        )
        print(f"\nMedians over {args.rounds} interleaved rounds; each timed run takes max(--steps,")
        print(f"{4 * PIPELINE} per agent stream) agent-steps. CPU vs floor: collect's against the")
        print(
            f"floor with its pipeline ({PIPELINE} in flight), the others' against the floor with 1."
        )
        print("Its floor's steps/s vs reference: what that floor reaches against the reference in")
        print("the same rounds; where the server saturates, it bounds every client's ratio.")
        print(
            f"The reference (a thread per agent) is skipped above {args.max_threads} agent streams"
        )
        print("(--max-threads): its rows and the ratios to it print '-'.")
        print("The machine is shared (2 cores): numbers are noisy.")
        print(pinned)


if __name__ == "__main__":
    main()
