"""random_action: every dtype, bounds, variable dimensions; checked with dm_env's validate."""

from __future__ import annotations

import numpy as np
import pytest
from dm_env import specs as dm_specs
from hypothesis import given, settings
from hypothesis import strategies as st

from dm_env_rpc_client import errors
from dm_env_rpc_client.random_actions import (
    UNBOUNDED_FLOAT,
    UNBOUNDED_INT,
    action_drawer,
    random_action,
)
from dm_env_rpc_client.specs import VariableArray, VariableBoundedArray

NUMERIC = [np.float32, np.float64, np.int8, np.int32, np.int64, np.uint8, np.uint32, np.uint64]


@st.composite
def numeric_specs(draw: st.DrawFn) -> dm_specs.Array:
    dtype = np.dtype(draw(st.sampled_from(NUMERIC)))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    kind = draw(st.sampled_from(["plain", "bounded", "discrete"]))
    if kind == "discrete" and dtype.kind in "iu":
        return dm_specs.DiscreteArray(draw(st.integers(1, 50)), dtype=dtype)
    if kind == "plain":
        return dm_specs.Array(shape, dtype)
    if dtype.kind == "f":
        low = draw(st.floats(-1e6, 1e6))
        high = low + draw(st.floats(0, 1e6))
    else:
        info = np.iinfo(dtype)
        low = draw(st.integers(int(info.min), int(info.max)))
        high = draw(st.integers(low, int(info.max)))
    return dm_specs.BoundedArray(shape, dtype, low, high)


@settings(max_examples=150, derandomize=True, deadline=None)
@given(spec=numeric_specs(), seed=st.integers(0, 2**32 - 1))
def test_random_actions_validate(spec: dm_specs.Array, seed: int) -> None:
    value = random_action(spec, seed)
    spec.validate(value)
    assert np.array_equal(value, random_action(spec, seed))  # deterministic for a seed


@settings(max_examples=60, derandomize=True, deadline=None)
@given(numeric_specs(), st.integers(0, 2**32 - 1))
def test_action_drawer_draws_what_random_action_draws(spec: dm_specs.Array, seed: int) -> None:
    """collect's drawer (the spec's work done once) gives random_action's values, types and
    dtypes from the same generator, draw after draw (scalars use size=None)."""
    draw = action_drawer({"a": spec, "b": [spec, dm_specs.Array((2,), bool)]})
    ours, theirs = np.random.default_rng(seed), np.random.default_rng(seed)
    for _ in range(3):
        got = draw(ours)
        want = random_action({"a": spec, "b": [spec, dm_specs.Array((2,), bool)]}, theirs)
        for one, two in [(got["a"], want["a"]), *zip(got["b"], want["b"], strict=True)]:
            assert type(one) is type(two)
            assert np.asarray(one).dtype == np.asarray(two).dtype
            assert np.array_equal(one, two)


def test_bool_strings_and_nested_structures() -> None:
    spec = {
        "flag": dm_specs.Array((3,), bool),
        "name": dm_specs.StringArray(()),
        "names": dm_specs.StringArray((2,)),
        "arm": [dm_specs.BoundedArray((), np.float32, -2.0, 2.0)],
    }
    value = random_action(spec, np.random.default_rng(3))
    spec["flag"].validate(value["flag"])
    assert isinstance(value["name"], str) and 1 <= len(value["name"]) <= 8
    assert value["name"].isalpha() and value["name"].islower()
    spec["names"].validate(value["names"])
    spec["arm"][0].validate(value["arm"][0])


def test_unbounded_ranges_are_documented_ones() -> None:
    rng = np.random.default_rng(0)
    floats = random_action(dm_specs.Array((1000,), np.float32), rng)
    assert floats.min() >= -UNBOUNDED_FLOAT and floats.max() < UNBOUNDED_FLOAT
    ints = random_action(dm_specs.Array((1000,), np.int64), rng)
    assert ints.min() >= -UNBOUNDED_INT and ints.max() <= UNBOUNDED_INT
    unsigned = random_action(dm_specs.Array((1000,), np.uint8), rng)
    assert unsigned.max() <= UNBOUNDED_INT
    half = random_action(dm_specs.BoundedArray((1000,), np.float64, 5.0, np.inf), rng)
    assert half.min() >= 5.0 and half.max() < 7.0


def test_variable_dimensions_take_a_documented_length() -> None:
    rng = np.random.default_rng(1)
    spec = VariableBoundedArray((-1, 2), np.float32, -1.0, 1.0, "v")
    lengths = set()
    for _ in range(50):
        value = random_action(spec, rng)
        spec.validate(value)
        lengths.add(value.shape[0])
    assert lengths == {1, 2, 3, 4}
    plain = VariableArray((3, -1), np.int32, name="p")
    plain.validate(random_action(plain, rng))


def test_specs_without_random_values() -> None:
    with pytest.raises(errors.SpecError, match="no random values"):
        random_action(dm_specs.Array((), object, name="blob"), 0)
    with pytest.raises(errors.SpecError, match="dm_env specs"):
        random_action(3, 0)


@settings(max_examples=60, derandomize=True, deadline=None)
@given(spec=numeric_specs(), seed=st.integers(0, 2**32 - 1))
def test_the_run_loops_blocks_draw_what_one_by_one_draws_would(
    spec: dm_specs.Array, seed: int
) -> None:
    # The run loop takes a world's random actions from blocks of BLOCK (_stepping.blocks):
    # for an action of one leaf, exactly the values random_action draws one at a time.
    from dm_env_rpc_client._stepping import blocks

    action_spec = {"a": spec}
    if not blocks.applies(action_spec):
        return
    rngs = [np.random.default_rng(seed), np.random.default_rng(seed + 1)]
    drawn = blocks.ActionBlocks(action_spec, rngs)
    one_by_one = [np.random.default_rng(seed), np.random.default_rng(seed + 1)]
    for turn in range(blocks.BLOCK + 3):  # past the first block
        worlds = [1, 0] if turn % 2 else [0]  # in any order, not every world each time
        stacked = drawn.take(worlds)["a"]
        assert stacked.dtype == np.dtype(spec.dtype) and stacked.shape == (len(worlds), *spec.shape)
        for row, world in zip(stacked, worlds, strict=True):
            expected = np.asarray(random_action(spec, one_by_one[world]))
            np.testing.assert_array_equal(row, expected)


def test_the_run_loop_draws_one_by_one_what_blocks_do_not_cover() -> None:
    from dm_env_rpc_client._stepping import blocks

    assert blocks.applies({"paddle": dm_specs.BoundedArray((), np.int8, -1, 1)})
    assert blocks.applies({"a": dm_specs.Array((2,), np.float32), "b": dm_specs.Array((), bool)})
    assert not blocks.applies({"v": VariableArray((-1,), np.int32)})  # a length of its own
    assert not blocks.applies({"s": dm_specs.StringArray(())})
    assert not blocks.applies({"big": dm_specs.Array((100,), np.float32)})  # over 64 bytes
    assert not blocks.applies([dm_specs.Array((), np.int8)])  # not a dict
