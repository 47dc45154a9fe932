"""A step's request as bytes (_step_encoder.ActionEncoder): step_request's bytes, and its errors."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import types
from collections.abc import Iterator
from typing import Any

import dm_env
import numpy as np
import pytest
from compare import assert_same
from conftest import sigstop
from dm_env import specs as dm_specs

import dm_env_rpc_client as dmr
from dm_env_rpc_client import errors, messages, specs
from dm_env_rpc_client._fastpath.step_encoder import MAX_TEMPLATES
from dm_env_rpc_client._proto import dm_env_rpc_pb2
from dm_env_rpc_client.connection import Connection
from dm_env_rpc_client.environment import DmEnvAdaptor
from dm_env_rpc_client.server import serve

SCALARS = {
    "f32": np.float32,
    "f64": np.float64,
    "i8": np.int8,
    "u8": np.uint8,
    "i32": np.int32,
    "i64": np.int64,
    "u32": np.uint32,
    "u64": np.uint64,
    "flag": np.bool_,
}
VARINTS = ("i32", "i64", "u32", "u64")


def action_specs() -> dict[str, Any]:
    """Every numeric dtype as an unbounded scalar; bounded scalars, arrays, nested names, a string."""
    return {
        **{name: dm_specs.Array((), dtype, name=name) for name, dtype in SCALARS.items()},
        "lim": {
            "f32": dm_specs.BoundedArray((), np.float32, -1.0, 1.0, name="f32"),
            "i64": dm_specs.BoundedArray((), np.int64, -1000, 1000, name="i64"),
        },
        "arm": {
            "joint": dm_specs.BoundedArray((6,), np.float32, -1.0, 1.0, name="joint"),
            "grip": dm_specs.DiscreteArray(3, dtype=np.uint8, name="grip"),
        },
        "vec": dm_specs.Array((3,), np.int32, name="vec"),
        "f64s": dm_specs.Array((2,), np.float64, name="f64s"),
        "bits": dm_specs.Array((4,), np.bool_, name="bits"),
        "text": dm_specs.StringArray((), name="text"),
    }


FLAT = specs.flatten_dm_env_specs(action_specs())
NUMERIC = [name for name in FLAT if name != "text"]


class Echo(dm_env.Environment):
    """Observation ``act``: every action's latest value (the server's view of what was sent)."""

    def __init__(self) -> None:
        self._act = {name: spec.generate_value() for name, spec in FLAT.items()}
        self._steps = 0

    def _timestep(self, step_type: dm_env.StepType) -> dm_env.TimeStep:
        observation = {"act": specs.unflatten(dict(self._act)), "count": np.int64(self._steps)}
        if step_type == dm_env.StepType.FIRST:
            return dm_env.restart(observation)
        return dm_env.transition(np.float32(0.5), observation, np.float32(1.0))

    def reset(self) -> dm_env.TimeStep:
        self._steps = 0
        return self._timestep(dm_env.StepType.FIRST)

    def step(self, action: Any) -> dm_env.TimeStep:
        self._act.update(specs.flatten(action))
        self._steps += 1
        return self._timestep(dm_env.StepType.MID)

    def observation_spec(self) -> dict[str, Any]:
        return {"act": action_specs(), "count": dm_specs.Array((), np.int64, name="count")}

    def action_spec(self) -> dict[str, Any]:
        return action_specs()


@pytest.fixture
def echo() -> Iterator[tuple[Connection, DmEnvAdaptor]]:
    """A connection to an Echo server and the adaptor of a world joined over it."""
    with serve(lambda settings: Echo()) as server, dmr.connect(server.address, timeout=10) as conn:
        env, _ = dmr.create_and_join_world(conn, {}, {}, timeout=10)
        env.reset()
        yield conn, env


def _fast(env: DmEnvAdaptor, action: Any) -> bytes | None:
    """What the adaptor's ActionEncoder makes of ``action`` (None: it takes step_request)."""
    assert env._encoder is not None
    return env._encoder.encode(action, env._step_request)


def _slow_bytes(env: DmEnvAdaptor, action: Any) -> bytes:
    """What the step_request path sends for ``action``."""
    return messages.envelope(env.step_request(action))[0]


def _varint_value(dtype: type, length: int, rng: np.random.Generator) -> int:
    """A value of ``dtype`` whose varint takes ``length`` bytes (10: negative, or the top bit)."""
    info = np.iinfo(dtype)
    if length == 10 and info.min < 0:
        return int(rng.integers(info.min, 0))
    low = 0 if length == 1 else 1 << 7 * (length - 1)
    high = min((1 << 7 * length) - 1, int(info.max))
    return int(rng.integers(low, high, endpoint=True, dtype=np.uint64))


def _lengths(dtype: type) -> list[int]:
    """The varint lengths values of ``dtype`` take."""
    info = np.iinfo(dtype)
    top = (int(info.max).bit_length() + 6) // 7
    return list(range(1, top + 1)) + ([10] if info.min < 0 and top < 10 else [])


_FLOATS = [0.0, -0.0, 1 / 3, 0.1, -2.5, 1e-45, 5e-324, 1e30, -1e-30, 3.4028234663852886e38]


def _value(name: str, rng: np.random.Generator, small: bool = False) -> Any:
    """A valid value for action ``name``, as a Python or a NumPy value, in every form the
    fast path covers (varints of random lengths, or of one byte if ``small``; floats that
    round; negative numbers)."""
    numpy_form = rng.random() < 0.5
    if name in SCALARS:
        dtype = SCALARS[name]
        if dtype is np.bool_:
            value: Any = bool(rng.random() < 0.5)
        elif name in VARINTS:
            length = 1 if small else int(rng.choice(_lengths(dtype)))
            value = _varint_value(dtype, length, rng)
        elif dtype in (np.int8, np.uint8):
            info = np.iinfo(dtype)
            value = int(rng.integers(info.min, info.max, endpoint=True))
        else:
            value = float(rng.choice(_FLOATS)) if rng.random() < 0.5 else rng.normal() * 1e6
            value = float(value) * (-1 if rng.random() < 0.3 else 1)
        return dtype(value) if numpy_form else value
    if name == "lim.f32":
        value = float(rng.uniform(-1.0, 1.0)) if rng.random() < 0.8 else float(rng.choice([-1, 1]))
        return np.float32(value) if numpy_form else value
    if name == "lim.i64":
        value = int(rng.integers(-1000, 1000, endpoint=True))
        return np.int64(value) if numpy_form else value
    if name == "arm.grip":
        return np.uint8(rng.integers(0, 3)) if numpy_form else int(rng.integers(0, 3))
    if name == "arm.joint":
        return rng.uniform(-1, 1, 6).astype(np.float32)
    if name == "vec":  # varints of one length: the payload as protobuf writes it
        return np.array([_varint_value(np.int32, 2, rng) for _ in range(3)], np.int32)
    if name == "f64s":
        return rng.normal(0, 1e3, 2)
    assert name == "bits"
    return rng.random(4) < 0.5


def test_every_dtype_name_order_and_nesting_gives_step_requests_bytes(echo) -> None:
    _, env = echo
    encoder, rng = env._encoder, np.random.default_rng(0)
    assert encoder is not None
    orders = [
        [str(n) for n in rng.permutation(NUMERIC)][: int(rng.integers(1, 8))] for _ in range(6)
    ]
    orders += [list(NUMERIC), [str(n) for n in rng.permutation(NUMERIC)]]
    reused = 0
    for draw in range(800):
        if len(encoder._templates) >= MAX_TEMPLATES:  # (a full encoder takes the slow path)
            encoder._templates.clear()
        names = orders[draw % len(orders)]
        action = {name: _value(name, rng, small=draw % 2 == 0) for name in names}
        form = specs.unflatten(action) if draw % 3 == 0 else action  # nested, or dotted names
        known = len(encoder._templates)
        assert encoder.encode(form, env._step_request) == _slow_bytes(env, form), (draw, form)
        reused += len(encoder._templates) == known  # this request's template was learned before
    assert reused > 300  # most of the small ones


@pytest.mark.parametrize("name", VARINTS)
def test_every_varint_length_reuses_its_template(echo, name: str) -> None:
    """Two values of each varint length: the second is written into the first one's template."""
    _, env = echo
    rng = np.random.default_rng(1)
    dtype = SCALARS[name]
    info = np.iinfo(dtype)
    for length in _lengths(dtype):
        for value in (_varint_value(dtype, length, rng), _varint_value(dtype, length, rng)):
            for form in (value, dtype(value)):
                action = {"i8": -3, name: form, "f32": 0.5}
                assert _fast(env, action) == _slow_bytes(env, action), (length, value)
    for value in (int(info.min), int(info.max), -1, 0, 127, 128):
        if info.min <= value <= info.max:
            assert _fast(env, {name: value}) == _slow_bytes(env, {name: value})


def test_what_the_fast_path_leaves_gives_the_same_bytes_by_step_request(echo) -> None:
    _, env = echo
    slow_but_valid = [
        {"f32": float("nan")},
        {"lim.f32": np.float32("nan")},  # NaN lies in bounds
        {"f32": float("inf")},  # no bounds: the dtype holds inf
        {"vec": np.array([1, 300, -2], np.int32)},  # varints of different lengths
        {"text": "héllo", "f32": 1.0},
        types.MappingProxyType({"i8": 1}),  # a Mapping, not a dict
        None,
    ]
    for action in slow_but_valid:
        assert _fast(env, action) is None, action
        data, expected, name = env._step_data(action)
        assert (data, expected, name) == (_slow_bytes(env, action), "step", "StepRequest")
    covered_other_forms = [
        {"f32": 3},  # an int for a float: _numeric's cast
        {"f32": np.float64(0.1)},
        {"f32": np.float16(1.5)},
        {"i32": np.int64(-5)},
        {"u8": np.array(7, np.uint8)},
        {"arm": {"joint": [0.5, -0.5, 0, 1, -1, 0.25], "grip": np.uint16(2)}},
        {"bits": [True, False, True, True], "f64s": np.array([1, 2], np.int16)},
        {},
    ]
    for action in covered_other_forms:
        assert _fast(env, action) == _slow_bytes(env, action), action


def _refused(env: DmEnvAdaptor) -> dict[str, Any]:
    good = {name: _value(name, np.random.default_rng(2)) for name in NUMERIC}
    assert _fast(env, good) is not None  # its template is known: no bad value slips through it

    def but(name: str, value: Any) -> dict[str, Any]:
        return {**good, name: value}

    return {
        "unknown name": but("nope", 1),
        "unknown nested name": {**good, "arm": {"joint": good["arm.joint"], "gripp": 1}},
        "float for an int": but("i32", 1.5),
        "bool for an int": but("i64", True),
        "int for a bool": but("flag", 1),
        "str for a number": but("f64", "1.0"),
        "number for a str": but("text", 5),
        "float32 for an int8": but("i8", np.float32(1.0)),
        "above the bounds": but("lim.f32", 1.5),
        "below the bounds": but("lim.i64", np.int64(-1001)),
        "int8 too large": but("i8", 128),
        "uint8 negative": but("u8", -1),
        "int32 too large": but("i32", 2**31),
        "int32 too small": but("i32", -(2**31) - 1),
        "int64 too large": but("i64", 2**63),
        "uint32 too large": but("u32", np.int64(2**32)),
        "uint64 negative": but("u64", -1),
        "uint64 too large": but("u64", 2**64),
        "float32 cannot hold it": but("f32", 1e39),
        "discrete out of range": but("arm.grip", 3),
        "array out of bounds": but("arm.joint", np.full(6, 2.0, np.float32)),
        "array NaN and out of bounds": but("arm.joint", np.array([np.nan] * 5 + [3.0], np.float32)),
        "wrong shape": but("f64s", np.zeros(3)),
        "scalar for an array": but("vec", 1),
        "ragged": but("vec", [[1], [1, 2]]),
        "a list, not a dict": [1, 2],
        "a number, not a dict": 3,
        "a name, not a dict": "f32",
    }


CASES = [
    "unknown name",
    "unknown nested name",
    "float for an int",
    "bool for an int",
    "int for a bool",
    "str for a number",
    "number for a str",
    "float32 for an int8",
    "above the bounds",
    "below the bounds",
    "int8 too large",
    "uint8 negative",
    "int32 too large",
    "int32 too small",
    "int64 too large",
    "uint32 too large",
    "uint64 negative",
    "uint64 too large",
    "float32 cannot hold it",
    "discrete out of range",
    "array out of bounds",
    "array NaN and out of bounds",
    "wrong shape",
    "scalar for an array",
    "ragged",
    "a list, not a dict",
    "a number, not a dict",
    "a name, not a dict",
]


@pytest.mark.parametrize("case", CASES)
def test_a_refused_action_raises_step_requests_error_and_sends_nothing(echo, case: str) -> None:
    conn, env = echo
    action = _refused(env)[case]
    with pytest.raises(errors.DmEnvRpcClientError) as before:
        env.step_request(action)
    assert _fast(env, action) is None
    for send in (env.step, env.step_async, lambda a: list(env.step_iter([a]))):
        with pytest.raises(type(before.value)) as got:
            send(action)
        assert str(got.value) == str(before.value)
    assert len(conn._pending) == 0
    assert env.step({"f32": 1.0}).observation["act"]["f32"] == np.float32(1.0)  # goes on


class OwnRequests(DmEnvAdaptor):
    """Makes its requests itself: doubles ``lim.i64`` (so the fast path must not be taken)."""

    def step_request(self, action: Any) -> dm_env_rpc_pb2.StepRequest:
        flat = specs.flatten(action)
        if "lim.i64" in flat:
            flat["lim.i64"] = 2 * flat["lim.i64"]
        return super().step_request(flat)


class OwnInner(DmEnvAdaptor):
    def _step_request(self, action: Any) -> dm_env_rpc_pb2.StepRequest:
        return super()._step_request(action)


@contextlib.contextmanager
def _joined(address: str, cls: type[DmEnvAdaptor], **kwargs: Any) -> Iterator[DmEnvAdaptor]:
    """A world of its own (over a connection of its own) as a ``cls`` adaptor."""
    with dmr.connect(address, timeout=10) as conn:
        world = dmr.create_world(conn, {})
        join = dm_env_rpc_pb2.JoinWorldRequest(world_name=world)
        specs = conn.send(join, 10).specs
        env = cls(conn, specs, world_name=world, destroy_on_close=True, **kwargs)
        yield env
        env.close()


def _steps(env: DmEnvAdaptor, actions: list[dict[str, Any]]) -> list[dm_env.TimeStep]:
    """The TimeSteps of ``actions`` by step, step_async and step_iter (a third each)."""
    third = len(actions) // 3
    out = [env.reset()]
    out += [env.step(action) for action in actions[:third]]
    futures = [env.step_async(action) for action in actions[third : 2 * third]]
    out += [future.result(timeout=10) for future in futures]
    out += list(env.step_iter(actions[2 * third :], in_flight=4))
    return out


def test_steps_give_the_timesteps_of_step_request_and_the_server_gets_the_action(echo) -> None:
    conn, fast = echo
    rng = np.random.default_rng(3)
    actions = []
    for _ in range(30):
        names = [str(n) for n in rng.permutation(NUMERIC)][: int(rng.integers(1, len(NUMERIC)))]
        actions.append(specs.unflatten({name: _value(name, rng) for name in names}))
    assert all(_fast(fast, action) is not None for action in actions)
    with _joined(conn.address, OwnInner) as slow:
        assert slow._encoder is None
        got, expected = _steps(fast, actions), _steps(slow, actions)
    for a, b in zip(got, expected, strict=True):
        assert_same(a, b)
    for timestep, action in zip(got[1:], actions, strict=True):
        for name, value in specs.flatten(action).items():
            echoed = specs.flatten(timestep.observation["act"])[name]
            assert echoed.dtype == FLAT[name].dtype
            np.testing.assert_array_equal(echoed, np.asarray(value).astype(FLAT[name].dtype))


def test_a_subclass_that_makes_its_own_requests_is_honoured(echo) -> None:
    conn, _ = echo
    with _joined(conn.address, OwnRequests) as env:
        assert env._encoder is None
        got = _steps(env, [{"lim": {"i64": 100 + i}, "f32": 0.5} for i in range(6)])
    assert [int(t.observation["act"]["lim"]["i64"]) for t in got[1:]] == [
        200 + 2 * i for i in range(6)
    ]
    with _joined(conn.address, DmEnvAdaptor, validate=False) as unchecked:
        assert unchecked._encoder is None  # pack_tensor's own conversions: the slow path
        unchecked.reset()
        assert unchecked.step({"i8": 1.0}).observation["act"]["i8"] == 1


def test_templates_are_bounded_and_new_specs_get_a_new_encoder(echo) -> None:
    _, env = echo
    rng = np.random.default_rng(4)
    encoder = env._encoder
    actions = [
        {name: _varint_value(SCALARS[name], length, rng)}
        for name in VARINTS
        for length in _lengths(SCALARS[name])
    ]
    actions += [{"f32": 1.0}, {"f64": 2.0}, {"flag": True}, {"f64": 2.0, "f32": 1.0}]
    assert len(actions) > MAX_TEMPLATES  # each its own template
    room = MAX_TEMPLATES - len(encoder._templates)  # (reset's step learned one: {})
    slow = 0
    for action in actions:
        fast = encoder.encode(action, env._step_request)
        assert len(encoder._templates) <= MAX_TEMPLATES
        if fast is None:
            assert len(encoder._templates) == MAX_TEMPLATES
            slow += 1
        else:
            assert fast == _slow_bytes(env, action)
        assert env._step_data(action)[0] == _slow_bytes(env, action)
    assert slow == len(actions) - room
    assert (
        encoder.encode({"i32": 5}, env._step_request) is not None
    )  # a learned one still is encoded
    # New specs on reset (the adaptor takes them): requests for the new specs.
    changed = dm_env_rpc_pb2.ActionObservationSpecs()
    changed.CopyFrom(env._wire_specs)
    changed.actions[max(changed.actions) + 1].CopyFrom(
        specs.dm_env_spec_to_tensor_spec(dm_specs.Array((), np.int32, name="more"))
    )
    env._reset_done(dm_env_rpc_pb2.ResetResponse(specs=changed))
    assert env._encoder is not encoder
    action = {"more": -7, "i32": 5}
    assert _fast(env, action) == _slow_bytes(env, action)


def test_the_async_adaptor_sends_the_same_steps(echo) -> None:
    conn, _ = echo
    rng = np.random.default_rng(5)
    actions = [{name: _value(name, rng) for name in NUMERIC} for _ in range(8)]
    with _joined(conn.address, OwnInner) as slow:
        expected = _steps(slow, actions[:6])

    async def main() -> list[dm_env.TimeStep]:
        env, _ = await dmr.create_and_join_world_async(conn.address, {}, {}, timeout=10)
        async with env:
            assert env._encoder is not None
            out = [await env.reset()]
            out += [await env.step(action) for action in actions[:4]]
            out += [timestep async for timestep in env.step_iter(actions[4:6], in_flight=2)]
            return out

    for a, b in zip(asyncio.run(main()), expected, strict=True):
        assert_same(a, b)


def test_a_step_sent_as_bytes_times_out_naming_its_request(server_process) -> None:
    message = r"No response to the StepRequest request within 0\.3 s\."
    server = server_process()
    with dmr.connect(server.address, timeout=20) as conn:
        env, _ = dmr.create_and_join_world(conn, {}, {}, timeout=0.3)
        env.reset()
        assert _fast(env, {"paddle": 1}) is not None
        sigstop(server.process)
        try:
            with pytest.raises(errors.RequestTimeoutError, match=message):
                env.step({"paddle": 1})
            with pytest.raises(errors.RequestTimeoutError, match=message):
                list(env.step_iter([{"paddle": 0}] * 3, in_flight=2))
        finally:
            os.kill(server.process.pid, signal.SIGCONT)

    server = server_process()

    async def main() -> None:
        env, _ = await dmr.create_and_join_world_async(server.address, {}, {}, timeout=0.3)
        await env.reset()
        sigstop(server.process)
        try:
            with pytest.raises(errors.RequestTimeoutError, match=message):
                await env.step({"paddle": 1})
            with pytest.raises(errors.RequestTimeoutError, match=message):
                async for _ in env.step_iter([{"paddle": 0}] * 3, in_flight=2):
                    pass
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        await env.connection.aclose()

    asyncio.run(main())


def test_steps_sent_as_bytes_wait_for_room_and_fail_on_a_closed_connection(
    server_process,
) -> None:
    server = server_process()
    conn = dmr.connect(server.address, timeout=20, max_in_flight=2)
    env, _ = dmr.create_and_join_world(conn, {}, {}, timeout=10)
    env.reset()
    assert _fast(env, {"paddle": 1}) is not None
    sigstop(server.process)  # hold the steps in flight
    try:
        held = [env.step_async({"paddle": 1}) for _ in range(2)]
        assert conn._slots is not None and conn._slots._value == 0  # type: ignore[attr-defined]
        third: list[Any] = []
        sender = threading.Thread(target=lambda: third.append(env.step_async({"paddle": 0})))
        sender.start()
        assert len(conn._pending) == 2  # the third waits for room
        conn.close()  # wakes it: it sees the closed connection
        sender.join(timeout=10)
        assert not sender.is_alive()
        for future in [*held, *third]:
            assert isinstance(future.exception(timeout=10), errors.ConnectionClosedError)
        late = env.step_async({"paddle": 0})
        assert isinstance(late.exception(timeout=0), errors.ConnectionClosedError)
        with pytest.raises(errors.ConnectionClosedError, match="closed"):
            env.step({"paddle": 0})
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        conn.close()
