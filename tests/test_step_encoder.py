"""BatchedEnvironment.send's fast path (_step_encoder): the per-world path's bytes, and its errors."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from dm_env import specs as dm_specs
from zoo import Zoo, _draw

from dm_env_rpc_client import errors, messages, specs
from dm_env_rpc_client.batched import BatchedEnvironment
from dm_env_rpc_client.server import serve

WORLDS = 4


@pytest.fixture
def zoo_batch() -> Iterator[BatchedEnvironment]:
    """A batch of zoo worlds: every numeric dtype among the actions, and a string one."""
    with (
        serve(lambda settings: Zoo(**settings)) as server,
        BatchedEnvironment.connect([server.address], WORLDS) as envs,
    ):
        envs.reset()
        yield envs


def _numeric_specs(envs: BatchedEnvironment) -> dict[str, dm_specs.Array]:
    flat = specs.flatten_dm_env_specs(envs.action_spec())
    return {name: spec for name, spec in flat.items() if np.dtype(spec.dtype).kind in "biuf"}


def _draw_stacked(spec: dm_specs.Array, mode: str, rng: np.random.Generator) -> np.ndarray:
    """``WORLDS`` values of ``spec``: "any" within the spec, or, for unbounded integers,
    "small" (varints of one byte) or "large" (negative or the top bit set: one length)."""
    dtype = np.dtype(spec.dtype)
    unbounded_int = dtype.kind in "iu" and not isinstance(spec, dm_specs.BoundedArray)
    shape = (WORLDS, *spec.shape)
    if unbounded_int and mode == "small":
        return rng.integers(0, 128, shape).astype(dtype)
    if unbounded_int and mode == "large":
        info = np.iinfo(dtype)
        low, high = (info.min, -1) if dtype.kind == "i" else (info.max // 2 + 1, info.max)
        return rng.integers(low, high, shape, dtype=dtype, endpoint=True)
    return np.stack([np.asarray(_draw(spec, rng), dtype) for _ in range(WORLDS)])


def _per_world_bytes(envs: BatchedEnvironment, actions: dict[str, Any]) -> list[bytes]:
    """What the per-world path (split, step_request, envelope) sends for ``actions``."""
    requests = envs._step_requests(actions, list(range(WORLDS)))
    return [messages.envelope(request)[0] for request in requests]


def test_the_fast_path_sends_the_per_world_paths_bytes(zoo_batch: BatchedEnvironment) -> None:
    envs, rng = zoo_batch, np.random.default_rng(0)
    numeric = _numeric_specs(envs)
    assert envs._encoder is not None
    # A few sets of names in random orders (each set and payload size has its template).
    orders = [
        [str(name) for name in rng.permutation(list(numeric))][: int(rng.integers(1, 11))]
        for _ in range(5)
    ]
    fast = 0
    for draw in range(150):
        names = orders[draw % len(orders)]
        mode = ("small", "large", "any")[draw % 3]
        actions = {name: _draw_stacked(numeric[name], mode, rng) for name in names}
        got = envs._encoder.encode(actions, WORLDS)
        if got is not None:
            fast += 1
            assert got == _per_world_bytes(envs, actions), (draw, names)
        elif mode != "any":  # only varints of different lengths leave the fast path
            raise AssertionError(f"draw {draw} ({names}) took the slow path")
    assert fast >= 100


def test_nested_actions_and_name_orders_keep_the_map_order(zoo_batch: BatchedEnvironment) -> None:
    envs, rng = zoo_batch, np.random.default_rng(1)
    numeric = _numeric_specs(envs)
    actions = {name: _draw_stacked(spec, "small", rng) for name, spec in numeric.items()}
    for order in range(8):
        names = [str(name) for name in rng.permutation(list(actions))] if order else list(actions)
        shuffled = {name: actions[name] for name in names}
        nested = specs.unflatten(shuffled)
        for form in (shuffled, nested):
            got = envs._encoder.encode(form, WORLDS)  # type: ignore[union-attr]
            assert got is not None and got == _per_world_bytes(envs, form)


def test_fast_path_steps_reach_the_server(zoo_batch: BatchedEnvironment) -> None:
    envs, rng = zoo_batch, np.random.default_rng(2)
    numeric = _numeric_specs(envs)
    for step in range(6):
        actions = {name: _draw_stacked(spec, "small", rng) for name, spec in numeric.items()}
        nested = specs.unflatten(actions)
        assert envs._encoder.encode(nested, WORLDS) is not None  # type: ignore[union-attr]
        batch = envs.step(nested, timeout=10)
        if batch.first().any():
            continue  # a FIRST step ignores its action; the next one echoes it
        echoed = specs.flatten(batch.observation["act"])
        for name, value in actions.items():
            np.testing.assert_array_equal(echoed[name], value, err_msg=f"step {step}: {name}")


def _refusals(envs: BatchedEnvironment) -> dict[str, dict[str, Any]]:
    """Batches the fast path refuses, each a fine batch (which it takes) with one thing wrong."""
    rng = np.random.default_rng(3)
    fine = {name: _draw_stacked(spec, "small", rng) for name, spec in _numeric_specs(envs).items()}
    assert envs._encoder.encode(fine, WORLDS) is not None  # type: ignore[union-attr]

    def but(name: str, value: Any) -> dict[str, Any]:
        return {**fine, name: value}

    out_of_bounds = fine["i8"].copy()
    out_of_bounds[2] = 9  # bounds [-5, 5]: world 2 is refused
    too_large = fine["i64"].astype(np.float64)
    too_large[3, 1] = 0.5
    return {
        "out of bounds": but("i8", out_of_bounds),
        "wrong dtype": but("i64", too_large),
        "overflow": but("u8", np.full((WORLDS, 2), 300, np.int64)),
        "bool for a number": but("i32", np.ones(WORLDS, bool)),
        "wrong shape": but("f64", np.zeros((WORLDS, 3))),
        "batch size": but("f32", np.zeros((WORLDS - 1, 2, 3), np.float32)),
        "unknown name": but("nope", np.zeros(WORLDS)),
        "a scalar": but("u32", np.uint32(1)),
        "ragged": but("f64", [[1.0, 2.0], [1.0], [1.0, 2.0], [1.0, 2.0]]),
    }


@pytest.mark.parametrize(
    "case",
    [
        "out of bounds",
        "wrong dtype",
        "overflow",
        "bool for a number",
        "wrong shape",
        "batch size",
        "unknown name",
        "a scalar",
        "ragged",
    ],
)
def test_a_refused_batch_raises_the_per_world_error_and_sends_nothing(
    zoo_batch: BatchedEnvironment, case: str
) -> None:
    envs = zoo_batch
    actions = _refusals(envs)[case]
    ids = list(range(WORLDS))
    assert envs._encoder.encode(actions, WORLDS) is None  # type: ignore[union-attr]
    with pytest.raises(Exception) as per_world:
        envs._step_requests(actions, ids)
    with pytest.raises(type(per_world.value)) as sent:
        envs.send(actions, ids)
    assert str(sent.value) == str(per_world.value)
    if case == "out of bounds":
        assert isinstance(sent.value, errors.WorldError) and sent.value.index == 2
    assert envs.pending() == 0


def test_a_closed_world_is_refused_by_name(zoo_batch: BatchedEnvironment) -> None:
    envs = zoo_batch
    actions = {"i8": np.zeros(WORLDS, np.int8)}
    envs.envs[1].close()
    with pytest.raises(errors.WorldError, match="World 1 .*closed") as info:
        envs.send(actions, list(range(WORLDS)))
    assert isinstance(info.value.__cause__, errors.ConnectionClosedError)
    assert envs.pending() == 0
    envs.send({"i8": np.zeros(2, np.int8)}, [0, 2])  # the open worlds take the fast path
    assert envs.recv(env_ids=[0, 2], timeout=10).env_ids.tolist() == [0, 2]


def test_string_actions_and_per_world_lists_take_the_per_world_path(
    zoo_batch: BatchedEnvironment,
) -> None:
    envs = zoo_batch
    with_text = {"i8": np.zeros(WORLDS, np.int8), "text": np.array(["a", "bé", "", "c"])}
    assert envs._encoder.encode(with_text, WORLDS) is None  # type: ignore[union-attr]
    batch = envs.step(with_text, timeout=10)
    assert batch.observation["act"]["text"].tolist() == ["a", "bé", "", "c"]
    listed = [{"i8": np.int8(i)} for i in range(WORLDS)]
    batch = envs.step(listed, timeout=10)
    assert batch.observation["act"]["i8"].tolist() == list(range(WORLDS))


def test_the_per_world_path_sends_step_requests_bytes(zoo_batch: BatchedEnvironment) -> None:
    """What the stacked fast path leaves (per-world dicts, varints of different lengths) is
    sent as each world's step_request bytes (through its adaptor's ActionEncoder)."""
    envs, rng = zoo_batch, np.random.default_rng(4)
    numeric = _numeric_specs(envs)
    ids = list(range(WORLDS))
    for draw in range(20):
        mode = ("small", "large", "any")[draw % 3]  # "any": a world's varint array may differ
        stacked = {name: _draw_stacked(spec, mode, rng) for name, spec in numeric.items()}
        listed = [{name: value[index] for name, value in stacked.items()} for index in ids]
        for actions in (stacked, listed, [specs.unflatten(action) for action in listed]):
            got = envs._step_requests(actions, ids, as_bytes=True)
            assert got == _per_world_bytes(envs, actions), draw
        if mode != "any":  # each world's request was written into its template
            for env, action in zip(envs.envs, listed, strict=True):
                assert env._encoder.encode(action, env._step_request) is not None  # type: ignore[union-attr]
