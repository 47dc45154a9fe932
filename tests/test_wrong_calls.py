"""Wrong calls of every public entry point get an SDK error that names the argument and says
what to pass instead, at once.

The table holds the wrong things a person plausibly passes: a string where an object goes, a
list where a string goes, an instance where a factory goes, a misspelled keyword, a negative or
zero number, and addresses of every bad shape. Each row asserts an ``ArgumentError`` (or another
SDK error that is also a TypeError or ValueError) whose message holds the given words: the
argument's name and what to pass. Nothing may wait: rows that connect pass a long timeout, and
the test's own timeout fails a row that waits it out.

``test_the_table_covers_every_public_callable`` makes a new entry point join the table (or the
short list of records and protocols, which are not called with user input).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import io
import os
import pathlib
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import pytest
from conftest import run_child
from dm_env import specs as dm_specs

import dm_env_rpc_client as dmr
from dm_env_rpc_client import cli, errors
from dm_env_rpc_client.server.catch import Catch

gym = pytest.importorskip("dm_env_rpc_client.integrations.gymnasium")
ray_integration = pytest.importorskip("dm_env_rpc_client.integrations.ray")

LONG = 60  # seconds: a row that waits for it fails by the test's timeout instead

BAD_ADDRESSES = [
    ("no-port", "127.0.0.1", ("has no port", "'host:port'")),
    ("port-99999", "127.0.0.1:99999", ("99999", "1 to 65535")),
    ("http-scheme", "http://127.0.0.1:50051", ("URL scheme", "'127.0.0.1:50051'")),
    ("empty", "", ("empty", "'host:port'")),
    ("spaces", "127.0.0.1: 50051", ("spaces", "'host:port'")),
    ("a-list", ["127.0.0.1:50051"], ("one address", "'host:port'")),
]


class World(NamedTuple):
    """A live server, a connection to it and a joined world, for rows that need them."""

    address: str
    conn: dmr.Connection
    env: dmr.DmEnvAdaptor
    folder: pathlib.Path


class Row(NamedTuple):
    entry: str  # the public name the row calls
    case: str
    call: Callable[[World], Any]
    words: tuple[str, ...]  # in the message: the argument's name, and what to pass


def _async(make: Callable[[], Any]) -> Callable[[World], Any]:
    return lambda world: asyncio.run(make())


def _address_rows(
    entry: str, call: Callable[[Any], Any], name: str = "address", skip: tuple[str, ...] = ()
) -> list[Row]:
    return [
        Row(entry, f"address-{case}", lambda w, a=address: call(a), (name, *words))
        for case, address, words in BAD_ADDRESSES
        if case not in skip
    ]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _async_world(address: str, call: Callable[[Any], Any]) -> Any:
    async with await dmr.connect_async(address, timeout=LONG) as conn:
        result = call(conn)
        return await result if inspect.isawaitable(result) else result


async def _async_send(address: str, timeout: Any) -> Any:
    return await _async_world(
        address, lambda conn: conn.send(dmr.dm_env_rpc_pb2.LeaveWorldRequest(), timeout)
    )


SPEC = dmr.dm_env_rpc_pb2.TensorSpec(name="x", dtype=dmr.DataType.FLOAT)

ROWS: list[Row] = [
    # --- connecting ---------------------------------------------------------------------------
    *_address_rows("connect", lambda a: dmr.connect(a, timeout=LONG)),
    Row("connect", "timeout-negative", lambda w: dmr.connect(w.address, timeout=-1), ("timeout=-1", "above 0")),
    Row("connect", "timeout-zero", lambda w: dmr.connect(w.address, timeout=0), ("timeout=0", "above 0")),
    Row("connect", "timeout-string", lambda w: dmr.connect(w.address, timeout="10"), ("timeout", "number of seconds")),
    Row("connect", "max-in-flight-zero", lambda w: dmr.connect(w.address, max_in_flight=0), ("max_in_flight=0", "at least 1")),
    Row("connect", "misspelled-keyword", lambda w: dmr.connect(w.address, timout=3), ("timout", "'timeout'")),
    *_address_rows("connect_async", lambda a: asyncio.run(dmr.connect_async(a, timeout=LONG))),
    Row("connect_async", "timeout-negative", _async(lambda: dmr.connect_async("127.0.0.1:1", timeout=-1)), ("timeout=-1", "above 0")),
    Row("create_secure_channel_and_connect", "address-no-port", lambda w: dmr.create_secure_channel_and_connect("127.0.0.1", timeout=LONG), ("has no port", "'host:port'")),
    Row("Connection", "string-for-channel", lambda w: dmr.Connection(w.address), ("channel", "dmr.connect(")),
    Row("Connection", "max-in-flight-negative", lambda w: dmr.Connection(w.conn._channel, max_in_flight=-2), ("max_in_flight=-2", "at least 1")),
    Row("AsyncConnection", "direct-construction", lambda w: dmr.AsyncConnection(), ("connect_async",)),
    Row("ForeignConnection", "string-for-connection", lambda w: dmr.ForeignConnection(w.address), ("connection", "dmr.connect(")),
    Row("PropertiesExtension", "string-for-connection", lambda w: dmr.PropertiesExtension(w.address), ("connection", "dmr.connect(")),
    # --- worlds -------------------------------------------------------------------------------
    Row("create_and_join_world", "misspelled-keyword", lambda w: dmr.create_and_join_world(w.conn, create_world_setting={}), ("create_world_setting", "'create_world_settings'")),
    Row("create_and_join_world", "list-for-connection", lambda w: dmr.create_and_join_world([w.address]), ("connection", "dmr.connect(")),
    Row("create_and_join_world", "timeout-negative", lambda w: dmr.create_and_join_world(w.address, timeout=-1), ("timeout=-1", "above 0")),
    *_address_rows("create_and_join_world", lambda a: dmr.create_and_join_world(a, timeout=LONG), skip=("a-list",)),
    Row("join_world", "misspelled-keyword", lambda w: dmr.join_world(w.conn, "world-1", join_world_setting={}), ("join_world_setting", "'join_world_settings'")),
    Row("create_world", "string-for-connection", lambda w: dmr.create_world(w.address), ("connection", "dmr.connect(")),
    Row("leave_world", "string-for-connection", lambda w: dmr.leave_world(w.address), ("connection", "dmr.connect(")),
    Row("destroy_world", "string-for-connection", lambda w: dmr.destroy_world(w.address, "world-1"), ("connection", "dmr.connect(")),
    Row("reset_world", "string-for-connection", lambda w: dmr.reset_world(w.address, "world-1"), ("connection", "dmr.connect(")),
    Row("join_world", "list-for-world-name", lambda w: dmr.join_world(w.conn, [w.env.world_name]), ("world_name is one world's name, a string", "not list")),
    Row("join_world", "list-for-settings", lambda w: dmr.join_world(w.conn, "world-1", ["seed"]), ("join_world_settings is a dict of settings", "not list")),
    Row("join_world", "timeout-nan", lambda w: dmr.join_world(w.conn, "world-1", timeout=float("nan")), ("timeout=nan", "above 0")),
    Row("destroy_world", "list-for-world-name", lambda w: dmr.destroy_world(w.conn, [w.env.world_name]), ("world_name is one world's name, a string", "not list")),
    Row("reset_world", "list-for-world-name", lambda w: dmr.reset_world(w.conn, [w.env.world_name]), ("world_name is one world's name, a string", "not list")),
    Row("reset_world", "list-for-settings", lambda w: dmr.reset_world(w.conn, w.env.world_name, ["seed"]), ("settings is a dict of settings", "not list")),
    Row("create_world", "list-for-settings", lambda w: dmr.create_world(w.conn, ["seed"]), ("create_world_settings is a dict of settings", "{'seed': 1}")),
    *[Row(entry, f"{label}timeout-{case}", call, words) for entry, label, make in [
        ("create_world", "", lambda w, t: dmr.create_world(w.conn, timeout=t)),
        ("leave_world", "", lambda w, t: dmr.leave_world(w.conn, timeout=t)),
        ("destroy_world", "", lambda w, t: dmr.destroy_world(w.conn, "world-1", timeout=t)),
        ("reset_world", "", lambda w, t: dmr.reset_world(w.conn, w.env.world_name, timeout=t)),
        ("create_and_join_world", "over-a-connection-", lambda w, t: dmr.create_and_join_world(w.conn, timeout=t)),
        ("Connection", "send-", lambda w, t: w.conn.send(dmr.dm_env_rpc_pb2.LeaveWorldRequest(), t)),
        ("Connection", "send-async-", lambda w, t: w.conn.send_async(dmr.dm_env_rpc_pb2.LeaveWorldRequest(), timeout=t)),
        ("DmEnvAdaptor", "", lambda w, t: dmr.DmEnvAdaptor(w.conn, w.env._wire_specs, timeout=t)),
        ("DmEnvAdaptor", "reset-", lambda w, t: w.env.reset(timeout=t)),
        ("DmEnvAdaptor", "close-", lambda w, t: w.env.close(timeout=t)),  # and it stays open
        ("AsyncConnection", "send-", lambda w, t: asyncio.run(_async_send(w.address, t))),
    ] for case, call, words in [
        ("negative", lambda w, m=make: m(w, -5), ("timeout=-5", "above 0")),
        ("zero", lambda w, m=make: m(w, 0), ("timeout=0", "above 0")),
        ("nan", lambda w, m=make: m(w, float("nan")), ("timeout=nan", "above 0")),
        ("string", lambda w, m=make: m(w, "5"), ("timeout is a number of seconds", "not str '5'")),
    ]],
    Row("DmEnvAdaptor", "dict-for-specs", lambda w: dmr.DmEnvAdaptor(w.conn, {}), ("specs is the world's ActionObservationSpecs", "not dict {}", "dmr.create_and_join_world(connection, create_world_settings=")),
    Row("DmEnvAdaptor", "string-for-requested-observations", lambda w: dmr.DmEnvAdaptor(w.conn, w.env._wire_specs, "board"), ("requested_observations is a list of observation names", "pass ['board']")),
    Row("DmEnvAdaptor", "list-for-extensions", lambda w: dmr.DmEnvAdaptor(w.conn, w.env._wire_specs, extensions=[object()]), ("extensions is a dict", "not list")),
    Row("DmEnvAdaptor", "step-iter-in-flight-zero", lambda w: list(w.env.step_iter([{"paddle": 1}], in_flight=0)), ("in_flight=0", "at least 1")),
    Row("AsyncDmEnvAdaptor", "dict-for-specs", lambda w: asyncio.run(_async_world(w.address, lambda a: dmr.AsyncDmEnvAdaptor(a, {}))), ("specs is the world's ActionObservationSpecs", "not dict {}")),
    Row("destroy_world_async", "list-for-world-name", lambda w: asyncio.run(_async_world(w.address, lambda a: dmr.destroy_world_async(a, ["w"]))), ("world_name is one world's name", "not list")),
    Row("join_world_async", "list-for-world-name", lambda w: asyncio.run(_async_world(w.address, lambda a: dmr.join_world_async(a, ["w"]))), ("world_name is one world's name", "not list")),
    Row("create_and_join_world_async", "timeout-string", _async(lambda: dmr.create_and_join_world_async("127.0.0.1:1", timeout="5")), ("timeout is a number of seconds", "not str '5'")),
    Row("connect", "dict-for-metadata", lambda w: dmr.connect(w.address, metadata={"key": "value"}), ("metadata is gRPC metadata", "list(metadata.items())")),
    Row("connect", "string-for-credentials", lambda w: dmr.connect(w.address, credentials="tls"), ("credentials is gRPC channel credentials", "grpc.ssl_channel_credentials()")),
    Row("connect_async", "dict-for-metadata", lambda w: asyncio.run(dmr.connect_async(w.address, metadata={"key": "value"})), ("metadata is gRPC metadata", "list(metadata.items())")),
    Row("PropertiesExtension", "list-for-key", lambda w: w.env.properties.read(["seed"]), ("key is one property's key, a string", "not list")),
    Row("PropertiesExtension", "list-for-key-to-write", lambda w: w.env.properties.write(["seed"], 1), ("key is one property's key, a string", "not list")),
    Row("SpecManager", "list-for-values", lambda w: w.env.action_manager.pack([1]), ("values is a dict of values keyed by name", "not list")),
    Row("create_and_join_world_async", "misspelled-keyword", _async(lambda: dmr.create_and_join_world_async("127.0.0.1:1", create_world_setting={})), ("create_world_setting", "'create_world_settings'")),
    Row("join_world_async", "misspelled-keyword", _async(lambda: dmr.join_world_async("127.0.0.1:1", "w", join_world_setting={})), ("join_world_setting", "'join_world_settings'")),
    Row("create_world_async", "sync-connection", lambda w: asyncio.run(dmr.create_world_async(w.conn)), ("AsyncConnection", "connect_async")),
    Row("leave_world_async", "string-for-connection", _async(lambda: dmr.leave_world_async("127.0.0.1:1")), ("AsyncConnection", "connect_async")),
    Row("destroy_world_async", "string-for-connection", _async(lambda: dmr.destroy_world_async("127.0.0.1:1", "w")), ("AsyncConnection", "connect_async")),
    Row("reset_world_async", "string-for-connection", _async(lambda: dmr.reset_world_async("127.0.0.1:1", "w")), ("AsyncConnection", "connect_async")),
    Row("DmEnvAdaptor", "string-for-connection", lambda w: dmr.DmEnvAdaptor(w.address, w.env._wire_specs), ("connection", "dmr.connect(")),
    Row("AsyncDmEnvAdaptor", "sync-connection", lambda w: dmr.AsyncDmEnvAdaptor(w.conn, w.env._wire_specs), ("AsyncConnection", "connect_async")),
    # --- batches ------------------------------------------------------------------------------
    Row("BatchedEnvironment", "strings-for-envs", lambda w: dmr.BatchedEnvironment([w.address]), ("envs", "BatchedEnvironment.connect(")),
    *_address_rows("BatchedEnvironment", lambda a: dmr.BatchedEnvironment.connect([a], timeout=LONG), "addresses"),
    Row("BatchedEnvironment", "list-for-settings", lambda w: dmr.BatchedEnvironment.connect([w.address], create_world_settings=["seed"]), ("create_world_settings is a dict of settings", "not list")),
    Row("BatchedEnvironment", "num-envs-zero", lambda w: dmr.BatchedEnvironment.connect([w.address], 0), ("num_envs=0", "at least 1")),
    Row("BatchedEnvironment", "timeout-negative", lambda w: dmr.BatchedEnvironment.connect([w.address], timeout=-1), ("timeout=-1", "above 0")),
    Row("BatchedEnvironment", "misspelled-keyword", lambda w: dmr.BatchedEnvironment.connect([w.address], create_world_setting={}), ("create_world_setting", "'create_world_settings'")),
    Row("RestartPolicy", "attempts-negative", lambda w: dmr.BatchedEnvironment.connect([w.address], on_world_failure="restart", restart=dmr.RestartPolicy(attempts=-1)), ("RestartPolicy.attempts=-1", "at least 1")),
    Row("RestartPolicy", "total-zero", lambda w: dmr.BatchedEnvironment.connect([w.address], on_world_failure="restart", restart=dmr.RestartPolicy(total=0)), ("RestartPolicy.total=0", "above 0")),
    Row("random_batch", "num-envs-zero", lambda w: dmr.random_batch(w.env.action_spec(), 0, 1), ("num_envs=0", "at least 1")),
    Row("random_action", "string-for-seed", lambda w: dmr.random_action(w.env.action_spec(), "seed"), ("rng is a NumPy Generator or an integer seed", "not str 'seed'")),
    Row("random_action", "string-for-spec", lambda w: dmr.random_action("paddle", 1), ("str", "dm_env specs")),
    # --- serving ------------------------------------------------------------------------------
    Row("serve", "instance-for-factory", lambda w: dmr.serve(Catch()), ("make_env", "Catch (the class)")),
    Row("serve", "string-for-factory", lambda w: dmr.serve("Catch"), ("make_env", "lambda settings")),
    Row("serve", "address-no-port", lambda w: dmr.serve(Catch, "127.0.0.1"), ("has no port", "'host:port'")),
    Row("serve", "address-port-99999", lambda w: dmr.serve(Catch, "127.0.0.1:99999"), ("99999", "0 to 65535")),
    Row("serve", "address-list", lambda w: dmr.serve(Catch, ["127.0.0.1:0"]), ("address", "'host:port'")),
    Row("serve", "max-workers-zero", lambda w: dmr.serve(Catch, max_workers=0), ("max_workers=0", "at least 1")),
    Row("serve", "misspelled-keyword", lambda w: dmr.serve(Catch, max_worker=4), ("max_worker", "'max_workers'")),
    Row("Server", "instance-for-factory", lambda w: dmr.Server(Catch()), ("make_env", "Catch (the class)")),
    Row("Property", "value-for-read", lambda w: dmr.Property(dm_specs.Array((), np.int32), 3), ("read", "lambda")),
    # --- tensors and specs --------------------------------------------------------------------
    Row("pack_tensor", "object", lambda w: dmr.pack_tensor(object()), ("object", "numeric array")),
    Row("pack_tensor", "unknown-dtype-name", lambda w: dmr.pack_tensor(1, dtype="nosuch"), ("nosuch",)),
    Row("unpack_tensor", "string-for-tensor", lambda w: dmr.unpack_tensor("1.0"), ("tensor", "pack_tensor")),
    Row("get_tensor_type", "string-for-tensor", lambda w: dmr.get_tensor_type("1.0"), ("tensor", "Tensor")),
    Row("data_type_to_np_type", "unknown-number", lambda w: dmr.data_type_to_np_type(999), ("999", "DataType")),
    Row("np_type_to_data_type", "unknown-name", lambda w: dmr.np_type_to_data_type("nosuch"), ("nosuch", "np.float32")),
    Row("SpecManager", "string-for-specs", lambda w: dmr.SpecManager("observations"), ("specs", "TensorSpec")),
    Row("bounds", "string-for-spec", lambda w: dmr.bounds("x"), ("spec", "TensorSpec")),
    Row("set_bounds", "min-above-max", lambda w: dmr.set_bounds(dmr.dm_env_rpc_pb2.TensorSpec(name="x", dtype=dmr.DataType.FLOAT), 2.0, 1.0), ("'x'", "min 2.0 is larger than max 1.0")),
    Row("dm_env_spec_to_tensor_spec", "string-for-spec", lambda w: dmr.dm_env_spec_to_tensor_spec("x"), ("spec", "dm_env")),
    Row("tensor_spec_to_dm_env_spec", "string-for-spec", lambda w: dmr.tensor_spec_to_dm_env_spec("x"), ("spec", "TensorSpec")),
    # --- recording ----------------------------------------------------------------------------
    Row("Recording", "worlds-zero", lambda w: dmr.Recording(w.folder / "r", 0), ("worlds=0", "at least 1")),
    Row("EpisodeRecorder", "world-negative", lambda w: dmr.EpisodeRecorder(w.folder / "e", -1), ("world=-1", "at least 0")),
    Row("load_episode", "number-for-path", lambda w: dmr.load_episode(123), ("path is an episode file's path", "not int 123")),
    Row("load_episode", "folder-for-file", lambda w: dmr.load_episode(w.folder), ("is a folder", "iter_episodes")),
    Row("iter_episodes", "missing-folder", lambda w: list(dmr.iter_episodes(w.folder / "nope")), ("nope", "folder")),
    # --- checking a server --------------------------------------------------------------------
    *_address_rows("check_server", lambda a: dmr.check_server(a, timeout=LONG)),
    Row("check_server", "timeout-zero", lambda w: dmr.check_server(w.address, timeout=0), ("timeout=0", "above 0")),
    Row("check_server", "latency-steps-zero", lambda w: dmr.check_server(w.address, latency_steps=0), ("latency_steps=0", "at least 1")),
    Row("check_server", "misspelled-keyword", lambda w: dmr.check_server(w.address, latency_step=5), ("latency_step", "'latency_steps'")),
    # --- launching servers --------------------------------------------------------------------
    Row("launch", "no-port-in-template", lambda w: dmr.launch("my_server --port 5"), ("{port}", "put {port} where")),
    Row("launch", "empty-command", lambda w: dmr.launch(""), ("command to launch is empty", "give a program")),
    Row("launch", "dict-for-command", lambda w: dmr.launch({"cmd": "s {port}"}), ("command", "a string or a list")),
    Row("launch", "num-servers-zero", lambda w: dmr.launch("s {port}", 0), ("num_servers", "at least 1")),
    Row("launch", "num-servers-string", lambda w: dmr.launch("s {port}", "2"), ("num_servers", "whole number")),
    Row("launch", "ready-timeout-negative", lambda w: dmr.launch("s {port}", ready_timeout=-1), ("ready_timeout=-1", "above 0")),
    Row("launch", "ports-not-one-per-server", lambda w: dmr.launch("s {port}", 2, ports=[5000]), ("one port per server", "1 ports for 2")),
    Row("launch", "misspelled-keyword", lambda w: dmr.launch("s {port}", num_server=2), ("num_server", "'num_servers'")),
    # --- the command line, from Python --------------------------------------------------------
    Row("cli_main", "string-for-argv", lambda w: dmr.cli_main("run --steps 5"), ("argv", "['run', '--steps', '5']")),
    # --- integrations -------------------------------------------------------------------------
    Row("GymnasiumEnv", "address-for-env", lambda w: gym.GymnasiumEnv(w.address), ("address=", "DmEnvAdaptor")),
    *_address_rows("GymnasiumEnv", lambda a: gym.GymnasiumEnv(address=a, timeout=LONG)),
    Row("GymnasiumEnv", "timeout-negative", lambda w: gym.GymnasiumEnv(address=w.address, timeout=-1), ("timeout=-1", "above 0")),
    Row("GymnasiumEnv", "misspelled-connect-keyword", lambda w: gym.GymnasiumEnv(address=w.address, connect_kwargs={"wait_for_redy": True}), ("wait_for_redy", "'wait_for_ready'")),
    Row("GymnasiumVectorEnv", "addresses-for-batch", lambda w: gym.GymnasiumVectorEnv(["127.0.0.1:1", "127.0.0.1:2"], num_envs=4), ("addresses=", "BatchedEnvironment")),
    Row("GymnasiumVectorEnv", "address-for-batch", lambda w: gym.GymnasiumVectorEnv("127.0.0.1:1"), ("addresses=", "BatchedEnvironment")),
    *_address_rows("GymnasiumVectorEnv", lambda a: gym.GymnasiumVectorEnv(addresses=[a], timeout=LONG), "addresses"),
    Row("GymnasiumVectorEnv", "num-envs-zero", lambda w: gym.GymnasiumVectorEnv(addresses=[w.address], num_envs=0), ("num_envs=0", "at least 1")),
    # --- option groups, the stepping loop, multi-agent worlds, tokens -------------------------
    Row("ConnectionOptions", "streams-per-connection-zero", lambda w: dmr.BatchedEnvironment.connect(w.address, 1, connection=dmr.ConnectionOptions(max_streams_per_connection=0), timeout=LONG), ("max_streams_per_connection=0", "at least 1")),
    Row("FailurePolicy", "unknown-policy", lambda w: dmr.BatchedEnvironment.connect(w.address, 1, failure_policy=dmr.FailurePolicy(on_world_failure="retry"), timeout=LONG), ("on_world_failure", "'raise' or 'restart'")),
    Row("collect", "address-for-batch", lambda w: dmr.collect(w.address, steps=10), ("dmr.BatchedEnvironment", "connect one first")),
    Row("MultiAgentWorld", "num-agents-zero", lambda w: dmr.MultiAgentWorld.connect(w.address, num_agents=0, timeout=LONG), ("num_agents=0", "at least 1")),
    *_address_rows("MultiAgentWorld", lambda a: dmr.MultiAgentWorld.connect(a, timeout=LONG), name="addresses", skip=("a-list",)),
    Row("MultiAgentBatch", "misspelled-keyword", lambda w: dmr.MultiAgentBatch.connect(w.address, 1, 2, timout=3), ("timout", "'timeout'")),
    Row("MultiAgentWorld", "misspelled-keyword", lambda w: dmr.MultiAgentWorld.connect(w.address, 2, step_timout=3), ("MultiAgentWorld.connect", "step_timout", "'step_timeout'")),
    Row("MultiAgentWorld", "keyword-given-both-ways", lambda w: dmr.MultiAgentWorld.connect(w.address, 2, step_timeout=5.0, failure_policy=dmr.FailurePolicy()), ("step_timeout=5.0 is given both", "FailurePolicy")),
    Row("MultiAgentBatch", "group-of-the-wrong-type", lambda w: dmr.MultiAgentBatch.connect(w.address, 1, 2, connection=dmr.FailurePolicy()), ("connection is a dmr.ConnectionOptions",)),
    Row("MultiAgentBatch", "streams-per-connection-zero", lambda w: dmr.MultiAgentBatch.connect(w.address, 1, 2, connection=dmr.ConnectionOptions(max_streams_per_connection=0), timeout=LONG), ("max_streams_per_connection=0", "at least 1")),
    Row("MultiAgentRecording", "agent-named-twice", lambda w: dmr.MultiAgentRecording(w.folder / "ma", ["a", "a"], 1), ("'a' is given twice", "a folder of its own")),
    Row("iter_agent_episodes", "missing-folder", lambda w: list(dmr.iter_agent_episodes(w.folder / "nope")), ("agents.json", "MultiAgentRecording")),
    Row("token_metadata", "number-for-token", lambda w: dmr.token_metadata(5), ("token", "not int")),
    Row("token_metadata", "empty-token", lambda w: dmr.token_metadata(""), ("token", "at least one character")),
    Row("GymnasiumVectorEnv", "no-addresses", lambda w: gym.GymnasiumVectorEnv(addresses=[]), ("addresses", "at least one")),
    Row("ServerFleet", "instance-for-factory", lambda w: ray_integration.ServerFleet(Catch()), ("make_env", "Catch (the class)")),
    Row("ServerFleet", "num-servers-zero", lambda w: ray_integration.ServerFleet(Catch, 0), ("num_servers=0", "at least 1")),
    Row("LaunchedFleet", "no-port-in-template", lambda w: ray_integration.LaunchedFleet("my_server --port 5"), ("{port}", "put {port} where")),
    Row("LaunchedFleet", "num-servers-zero", lambda w: ray_integration.LaunchedFleet("s {port}", 0), ("num_servers=0", "at least 1")),
]  # fmt: skip

# Public callables that no person calls with input of their own: records the SDK builds and
# returns (NamedTuples, dataclasses), typing protocols, and the DataType enum. Exception
# classes are left out by type.
NOT_ENTRY_POINTS = {
    "BatchedTimeStep": "a record the batch returns",
    "Bounds": "a record bounds() returns",
    "ConnectionLike": "a typing Protocol",
    "ConformanceReport": "a record check_server returns",
    "CreateAndJoinResult": "a record create_and_join_world returns",
    "DataType": "the protocol's enum (its own ValueError names the value)",
    "Episode": "a record load_episode returns",
    "LaunchedServer": "a record LaunchedServers holds, one per process launch started",
    "LaunchedServers": "what launch returns",
    "Relaunch": "a record of one relaunch (LaunchedServers.relaunches)",
    "RelaunchPolicy": "a NamedTuple of relaunch bounds, given to launch",
    "ErrorCode": "the code server errors carry (its own TypeError: tests/test_dropin.py)",
    "PropertySpec": "a record the properties extension returns",
    "WorldFailure": "a record the batch's failures hold",
    "show": "takes any value: it shows what it is given",
    "ConnectionType": "the reference's name for the ConnectionLike Protocol",
    "Metadata": "a type alias (Sequence[tuple[str, str]])",
    "RunEvent": "a record collect hands its observers",
    "RunObserver": "a typing Protocol",
    "RunStats": "a record collect returns",
}
# The integrations' public classes, beside dmr.__all__ (records, errors and AnyText, a
# gymnasium space with gymnasium's own checks, left out).
INTEGRATION_CLASSES = {
    gym: {"GymnasiumEnv", "GymnasiumVectorEnv"},
    ray_integration: {"ServerFleet", "LaunchedFleet"},
}


def _public_callables(module: Any) -> set[str]:
    names = set()
    for name in module.__all__:
        try:
            value = getattr(module, name)
        except ImportError:  # a name imported on first use, whose extra is not installed
            continue
        if not callable(value) or (isinstance(value, type) and issubclass(value, BaseException)):
            continue
        names.add(name)
    return names


def test_the_table_covers_every_public_callable() -> None:
    in_table = {row.entry for row in ROWS}
    public = _public_callables(dmr) - set(NOT_ENTRY_POINTS)
    assert sorted(public - in_table) == [], "add wrong calls of these entry points to ROWS"
    for module, classes in INTEGRATION_CLASSES.items():
        callables = _public_callables(module)  # without names whose extra is missing
        found = {name for name in callables if inspect.isclass(getattr(module, name))}
        # AnyText: a gymnasium space; RLlinkStats: the record run_rllink returns.
        records = {n for n in found if issubclass(getattr(module, n), tuple)} | {
            "AnyText",
            "RLlinkStats",
        }
        assert sorted(found - records - classes) == [], f"add {module.__name__}'s classes"
    assert sorted(in_table - public - set().union(*INTEGRATION_CLASSES.values())) == []


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with (
        dmr.serve(lambda settings: Catch(**settings)) as server,
        dmr.connect(server.address, timeout=LONG) as conn,
    ):
        env, _ = dmr.create_and_join_world(conn, {}, {}, timeout=LONG)
        yield World(server.address, conn, env, tmp_path_factory.mktemp("wrong_calls"))
        env.close()


@pytest.mark.timeout(20)
@pytest.mark.parametrize("row", ROWS, ids=lambda row: f"{row.entry}-{row.case}")
def test_a_wrong_call_gets_an_sdk_error_naming_the_argument(row: Row, world: World) -> None:
    with pytest.raises(errors.DmEnvRpcClientError) as info:
        result = row.call(world)
        with contextlib.suppress(Exception):  # it went through: do not leave it open
            result.close() if hasattr(result, "close") else result.stop()
    assert not world.env._closed, "a wrong call closed the world's adaptor"
    error = info.value
    assert isinstance(error, (TypeError, ValueError, OSError)), repr(error)
    message = str(error)
    for word in row.words:
        assert word in message, f"{word!r} not in {message!r}"


CLI_ROWS = [
    (["run", "--address", "127.0.0.1"], "'127.0.0.1' is not host:port"),
    (["run", "--address", "127.0.0.1:99999"], "'127.0.0.1:99999' is not host:port"),
    (["run", "--address", "http://127.0.0.1:50051"], "--address 'http://127.0.0.1:50051' has a URL scheme"),
    (["run", "--address", "127.0.0.1: 50051"], "is not host:port"),
    (["run", "--address", ""], "'' is not host:port"),
    (["run", "--in-process", "--address", "127.0.0.1:50051"], "--in-process"),
    (["run", "--steps", "0"], "argument --steps: must be at least 1"),
    (["run", "--timeout", "-1"], "argument --timeout"),
    (["run", "--pipeline", "x"], "argument --pipeline: expected a whole number"),
    (["run", "--stepz", "5"], "unrecognized arguments: --stepz"),
    (["specs", "http://127.0.0.1:50051"], "has a URL scheme"),
    (["serve", "--port", "99999"], "argument --port: a port is 0 to 65535"),
]  # fmt: skip


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "argv, words", CLI_ROWS, ids=lambda v: " ".join(v) if isinstance(v, list) else ""
)
def test_a_wrong_command_line_exits_2_naming_the_option(argv: list[str], words: str) -> None:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exited:
        raise SystemExit(cli.main(argv))
    assert exited.value.code == 2
    assert words in stderr.getvalue()


def test_a_closed_port_is_refused_at_once_and_waiting_says_refused_too() -> None:
    address = f"127.0.0.1:{_free_port()}"
    with pytest.raises(
        errors.ConnectRefusedError, match=r"connection refused.*wait_for_ready=True"
    ):
        dmr.connect(address, timeout=LONG)  # a wait would fail by pytest's timeout
    with pytest.raises(errors.ConnectTimeoutError, match="The last attempt was refused"):
        dmr.connect(address, timeout=0.3, wait_for_ready=True)
    with pytest.raises(errors.ConnectRefusedError):
        gym.GymnasiumEnv(address=address, timeout=LONG)


def test_grpc_info_lines_stay_off_a_scripts_terminal_and_a_chosen_level_holds(
    tmp_path: pathlib.Path,
) -> None:
    """A script whose server stops while a connection is open: gRPC's "Got goaway" INFO line
    at exit was printed; GRPC_VERBOSITY set by the user still shows it, and the library leaves
    the variable as it found it (so child processes see the user's environment)."""
    script = tmp_path / "script.py"
    script.write_text(
        "import os\n"
        "import dm_env_rpc_client as dmr\n"
        "from dm_env_rpc_client.server.catch import Catch\n"
        "assert 'GRPC_VERBOSITY' not in os.environ or os.environ['GRPC_VERBOSITY'] == 'INFO'\n"
        "for _ in range(6):  # the line comes about 2 times in 3: six tries make it certain\n"
        "    server = dmr.serve(Catch)\n"
        "    conn = dmr.connect(server.address, timeout=30)\n"
        "    env, _ = dmr.create_and_join_world(conn, {}, {}, timeout=30)\n"
        "    env.reset()\n"
        "    server.stop()\n"
    )
    environment = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    quiet = run_child([sys.executable, str(script)], timeout=60, env=environment)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""  # no "chttp2_transport.cc ... Got goaway" line, nor any other
    chatty = run_child(
        [sys.executable, str(script)], timeout=60, env={**environment, "GRPC_VERBOSITY": "INFO"}
    )
    assert chatty.returncode == 0, chatty.stderr
    assert "Log level INFO" in chatty.stderr  # the user's choice holds: gRPC says it is INFO
