"""Spec bounds, SpecManager and dm_env spec conversion."""

from __future__ import annotations

import numpy as np
import pytest
from dm_env import specs as dm_specs
from dm_env_rpc.v1 import tensor_spec_utils as reference_specs
from hypothesis import given, settings
from hypothesis import strategies as st

from dm_env_rpc_client import errors, specs, tensors
from dm_env_rpc_client._proto import dm_env_rpc_pb2

DataType = dm_env_rpc_pb2.DataType
TensorSpec = dm_env_rpc_pb2.TensorSpec


def _spec(name: str, dtype: int, shape: tuple[int, ...] = (), low=None, high=None) -> TensorSpec:
    spec = TensorSpec(name=name, dtype=dtype, shape=shape)
    if low is not None or high is not None:
        specs.set_bounds(spec, low, high)
    return spec


@pytest.fixture
def manager() -> specs.SpecManager:
    return specs.SpecManager(
        {
            1: _spec("paddle", DataType.INT8, (), -1, 1),
            2: _spec("arm.joint", DataType.FLOAT, (2,), [-1.0, -2.0], [1.0, 2.0]),
            3: _spec("arm.grip", DataType.BOOL),
            4: _spec("text", DataType.STRING),
            5: _spec("trace", DataType.DOUBLE, (-1,), -10.0, 10.0),
        },
        kind="action",
    )


@pytest.mark.parametrize(
    ("dtype", "low", "high"),
    [
        (DataType.INT8, -1, 1),
        (DataType.UINT32, 0, 4_000_000_000),
        (DataType.INT64, -(2**62), 2**62),
        (DataType.FLOAT, -0.5, 2.5),
        (DataType.DOUBLE, [0.0, 1.0], [1.0, 3.0]),
    ],
)
def test_bounds_round_trip_and_match_reference(dtype: int, low, high) -> None:
    shape = (2,) if isinstance(low, list) else ()
    spec = _spec("x", dtype, shape, low, high)
    got = specs.bounds(spec)
    assert np.array_equal(got.min, low) and np.array_equal(got.max, high)
    expected = reference_specs.bounds(spec)
    assert np.array_equal(got.min, expected.min) and np.array_equal(got.max, expected.max)


def test_unset_bounds_default_to_dtype_limits() -> None:
    assert specs.bounds(_spec("i", DataType.INT32)) == (-(2**31), 2**31 - 1)
    low, high = specs.bounds(_spec("f", DataType.FLOAT))
    assert low == -np.inf and high == np.inf


@pytest.mark.parametrize(
    ("dtype", "shape", "low", "high", "match"),
    [
        (DataType.STRING, (), 0, 1, "non-numeric"),
        (DataType.INT8, (), 0, 300, "does not fit int8"),
        (DataType.FLOAT, (), 2.0, 1.0, "larger than max"),
        (DataType.FLOAT, (), float("nan"), 1.0, "NaN"),
        (DataType.INT32, (), 0.5, 1, "not integral"),
        (DataType.FLOAT, (-1,), [0.0, 0.0], [1.0, 1.0], "scalar bounds only"),
        (DataType.FLOAT, (3,), [0.0, 0.0], 1.0, "shape"),
    ],
)
def test_set_bounds_rejects_bad_bounds(dtype: int, shape, low, high, match: str) -> None:
    with pytest.raises(errors.BoundsError, match=match):
        _spec("x", dtype, shape, low, high)


def test_bounds_of_mismatched_payload_type() -> None:
    spec = _spec("x", DataType.INT32, (), 0, 1)
    spec.dtype = DataType.FLOAT
    with pytest.raises(errors.BoundsError, match="dtype FLOAT but its min is of type int32s"):
        specs.bounds(spec)


def test_names_uids_and_lookups(manager: specs.SpecManager) -> None:
    assert manager.names() == ["paddle", "arm.joint", "arm.grip", "text", "trace"]
    assert manager.uids() == [1, 2, 3, 4, 5]
    assert manager.name_to_uid("arm.grip") == 3
    assert manager.uid_to_name(2) == "arm.joint"
    assert manager.name_to_spec("paddle").dtype == DataType.INT8
    assert manager.uid_to_spec(4).name == "text"
    with pytest.raises(errors.UnknownNameError, match="'nope'.*'arm.grip', 'arm.joint'"):
        manager.name_to_uid("nope")
    with pytest.raises(errors.UnknownUidError, match="UID 99. Known UIDs: 1, 2, 3, 4, 5"):
        manager.uid_to_name(99)


def test_duplicate_names_are_rejected() -> None:
    with pytest.raises(errors.DuplicateNameError, match="1 and 2 share the name 'a'"):
        specs.SpecManager({1: _spec("a", DataType.FLOAT), 2: _spec("a", DataType.INT32)})


def test_pack_unpack_nested(manager: specs.SpecManager) -> None:
    values = {
        "paddle": 1,
        "arm": {"joint": np.array([0.5, 1.5], np.float32), "grip": True},
        "text": "hi",
        "trace": np.arange(5, dtype=np.float64),
    }
    packed = manager.pack(values)
    assert sorted(packed) == [1, 2, 3, 4, 5]
    out = manager.unpack(packed)
    assert out["paddle"] == 1 and out["paddle"].dtype == np.int8
    assert out["arm"]["joint"].tolist() == [0.5, 1.5] and bool(out["arm"]["grip"])
    assert out["text"] == "hi" and out["trace"].shape == (5,)
    flat = manager.unpack(packed, nested=False)
    assert set(flat) == {"paddle", "arm.joint", "arm.grip", "text", "trace"}
    assert manager.pack({"arm.grip": False})[3].bools.array[0] is False


@pytest.mark.parametrize(
    ("values", "error", "match"),
    [
        ({"paddle": 2}, errors.SpecValidationError, r"'paddle' must lie in \[-1, 1\] but got 2"),
        ({"paddle": 1.0}, errors.SpecValidationError, "'paddle' expects dtype int8"),
        ({"paddle": 200}, errors.SpecValidationError, "int8 cannot hold it"),
        (
            {"arm": {"joint": np.array([0.0, 3.0], np.float32)}},
            errors.SpecValidationError,
            r"must lie in \[-2.0, 2.0\] but got 3.0 at index \(1,\)",
        ),
        ({"arm.joint": np.zeros(3, np.float32)}, errors.SpecValidationError, r"shape \[2\]"),
        ({"arm.grip": np.float32(1.0)}, errors.SpecValidationError, "astype"),
        ({"text": 3}, errors.SpecValidationError, "expects dtype str"),
        ({"trace": np.zeros((2, 2))}, errors.SpecValidationError, r"shape \[-1\]"),
        ({"nope": 1}, errors.UnknownNameError, "Known names"),
    ],
)
def test_pack_validation_errors(manager: specs.SpecManager, values, error, match: str) -> None:
    with pytest.raises(error, match=match):
        manager.pack(values)


def test_validation_can_be_switched_off() -> None:
    spec = _spec("paddle", DataType.INT8, (), -1, 1)
    fast = specs.SpecManager({1: spec}, validate=False)
    assert tensors.unpack_tensor(fast.pack({"paddle": 5})[1]) == 5


def test_dm_env_spec_conversion() -> None:
    discrete = specs.tensor_spec_to_dm_env_spec(_spec("d", DataType.INT32, (), 0, 4))
    assert isinstance(discrete, dm_specs.DiscreteArray) and discrete.num_values == 5
    bounded = specs.tensor_spec_to_dm_env_spec(_spec("b", DataType.FLOAT, (2,), -1.0, 1.0))
    assert isinstance(bounded, dm_specs.BoundedArray) and bounded.shape == (2,)
    plain = specs.tensor_spec_to_dm_env_spec(_spec("p", DataType.UINT8, (3, 4)))
    assert type(plain) is dm_specs.Array and plain.dtype == np.uint8
    text = specs.tensor_spec_to_dm_env_spec(_spec("s", DataType.STRING, (2,)))
    assert isinstance(text, dm_specs.StringArray)
    for spec in (discrete, bounded, plain):
        back = specs.dm_env_spec_to_tensor_spec(spec)
        assert specs.tensor_spec_to_dm_env_spec(back) == spec
    assert specs.dm_env_spec_to_tensor_spec(text).dtype == DataType.STRING


def test_variable_dimensions_validate_in_dm_env() -> None:
    spec = specs.tensor_spec_to_dm_env_spec(_spec("v", DataType.FLOAT, (-1, 2), -1.0, 1.0))
    assert spec.shape == (-1, 2)
    spec.validate(np.zeros((7, 2), np.float32))
    spec.validate(np.zeros((0, 2), np.float32))
    assert spec.generate_value().shape == (0, 2)
    with pytest.raises(ValueError):
        spec.validate(np.zeros((7, 3), np.float32))
    with pytest.raises(ValueError):
        spec.validate(np.full((1, 2), 5.0, np.float32))
    unbounded = specs.tensor_spec_to_dm_env_spec(_spec("u", DataType.INT32, (-1,)))
    unbounded.validate(np.zeros(4, np.int32))


def test_manager_dm_env_specs_are_nested(manager: specs.SpecManager) -> None:
    nested = manager.dm_env_specs()
    assert set(nested) == {"paddle", "arm", "text", "trace"}
    assert set(nested["arm"]) == {"joint", "grip"}


def test_nesting_clash() -> None:
    with pytest.raises(errors.SpecError, match="prefix"):
        specs.unflatten({"a": 1, "a.b": 2})


@settings(max_examples=40, derandomize=True, deadline=None)
@given(
    dtype=st.sampled_from([DataType.INT8, DataType.INT32, DataType.UINT8, DataType.FLOAT]),
    low=st.integers(-100, 100),
    width=st.integers(0, 50),
    value=st.integers(-200, 200),
)
def test_bounds_check_agrees_with_dm_env(dtype: int, low: int, width: int, value: int) -> None:
    np_dtype = tensors.DATA_TYPE_TO_NUMPY[dtype]
    if np_dtype.kind == "u":
        low, value = abs(low), abs(value)
    if np_dtype.kind in "iu":
        info = np.iinfo(np_dtype)
        value = int(np.clip(value, info.min, info.max))
        width = min(width, int(info.max) - low)
    spec = _spec("x", dtype, (), low, low + width)
    manager = specs.SpecManager({1: spec})
    dm_spec = specs.tensor_spec_to_dm_env_spec(spec)
    array = np.asarray(value, dtype=np_dtype)
    try:
        dm_spec.validate(array)
        inside = True
    except ValueError:
        inside = False
    if inside:
        manager.pack({"x": array})
    else:
        with pytest.raises(errors.SpecValidationError):
            manager.pack({"x": array})


def test_docs_examples_run(capsys: pytest.CaptureFixture[str]) -> None:
    import pathlib
    import re

    path = pathlib.Path(__file__).parent.parent / "docs" / "specs.md"
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
    assert len(blocks) >= 4
    for index, block in enumerate(blocks):
        exec(compile(block, f"{path.name}[{index}]", "exec"), {})
    assert "NaN is not a bound" in capsys.readouterr().out


def test_bound_messages_show_values_as_given() -> None:
    with pytest.raises(errors.BoundsError, match="min 2 is larger than max 1"):
        _spec("x", DataType.INT8, (), 2, 1)
    with pytest.raises(errors.BoundsError, match="NaN is not a bound"):
        _spec("x", DataType.INT32, (), float("nan"), 1)


def test_numpy_values_are_range_checked_and_bools_stay_bools(
    manager: specs.SpecManager,
) -> None:
    with pytest.raises(errors.SpecValidationError, match="int8 cannot hold it"):
        manager.pack({"paddle": np.int64(300)})
    with pytest.raises(errors.SpecValidationError, match="expects dtype int8"):
        manager.pack({"paddle": np.bool_(True)})
    packed = manager.pack({"paddle": np.int64(-1), "trace": np.arange(3, dtype=np.float32)})
    assert manager.unpack(packed)["paddle"].dtype == np.int8
    assert manager.unpack(packed)["trace"].dtype == np.float64


@settings(max_examples=300, deadline=None)
@given(
    dtype=st.sampled_from(
        [
            DataType.INT8,
            DataType.UINT8,
            DataType.INT64,
            DataType.UINT64,
            DataType.FLOAT,
            DataType.DOUBLE,
            DataType.BOOL,
        ]
    ),
    bounded=st.booleans(),
    value=st.one_of(
        st.integers(-(2**70), 2**70),
        st.integers(-300, 300),
        st.floats(allow_nan=True, allow_infinity=True),
        st.booleans(),
    ),
)
def test_python_scalars_fast_path_agrees_with_the_general_checks(
    dtype: int, bounded: bool, value
) -> None:
    # Python numbers for scalar specs skip NumPy's checks; the outcome must not change.
    low, high = (-5, 100) if bounded and dtype != DataType.BOOL else (None, None)
    if bounded and dtype in (DataType.UINT8, DataType.UINT64):
        low = 0
    spec = _spec("x", dtype, (), low, high)
    fast = specs.SpecManager({1: spec}, kind="action")
    general = specs.SpecManager({1: spec}, kind="action")
    general._by_name["x"] = general._by_name["x"]._replace(scalar_types=())

    def outcome(manager: specs.SpecManager) -> object:
        try:
            return manager.pack({"x": value})[1].SerializeToString()
        except errors.SpecValidationError as exc:
            return str(exc)

    assert fast._by_name["x"].scalar_types
    assert outcome(fast) == outcome(general)


@pytest.mark.parametrize(
    ("dtype", "values"),
    [
        (DataType.INT8, [-128, -6, -5, 0, 100, 101, 127]),
        (DataType.UINT8, [0, 1, 100, 101, 255]),
        (DataType.INT64, [-(2**63), -6, -5, 100, 101, 2**63 - 1]),
        (DataType.UINT64, [0, 100, 101, 2**64 - 1]),
        (DataType.FLOAT, [float("nan"), float("inf"), -float("inf"), -5.0, 100.0, 100.5, 3e38]),
        (DataType.DOUBLE, [float("nan"), -5.5, -5.0, 100.0, 1e300]),
        (DataType.BOOL, [True, False]),
    ],
)
@pytest.mark.parametrize("bounded", [False, True])
def test_numpy_scalars_of_the_spec_dtype_take_the_fast_path_with_the_same_outcome(
    dtype: int, values: list, bounded: bool
) -> None:
    low, high = (-5, 100) if bounded and dtype != DataType.BOOL else (None, None)
    if bounded and dtype in (DataType.UINT8, DataType.UINT64):
        low = 0
    spec = _spec("x", dtype, (), low, high)
    fast = specs.SpecManager({1: spec}, kind="action")
    general = specs.SpecManager({1: spec}, kind="action")
    general._by_name["x"] = general._by_name["x"]._replace(scalar_types=())
    numpy_type = tensors.DATA_TYPE_TO_NUMPY[dtype].type

    def outcome(manager: specs.SpecManager, value: object) -> object:
        try:
            return manager.pack({"x": value})[1].SerializeToString()
        except errors.SpecValidationError as exc:
            return str(exc)

    for value in values:
        scalar = numpy_type(value)
        assert outcome(fast, scalar) == outcome(general, scalar), scalar


def test_floats_a_float32_spec_cannot_hold_are_refused(manager: specs.SpecManager) -> None:
    with pytest.raises(errors.SpecValidationError, match=r"float32 cannot hold it"):
        manager.pack({"arm.joint": np.array([0.0, -1e300])})
    flat = specs.SpecManager({1: _spec("x", DataType.FLOAT)}, kind="action")
    for value in (1e300, np.float64(-1e39)):
        with pytest.raises(
            errors.SpecValidationError, match=r"'x' must lie in .*float32 cannot hold it"
        ):
            flat.pack({"x": value})
    # inf and NaN are values a float32 holds: they pass, as dm_env's validate() lets them.
    assert np.isinf(flat.unpack(flat.pack({"x": float("inf")}))["x"])
    assert np.isnan(flat.unpack(flat.pack({"x": float("nan")}))["x"])
    assert flat.unpack(flat.pack({"x": 3e38}))["x"] == np.float32(3e38)
