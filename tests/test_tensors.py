"""The tensor codec: round trips, byte equality with the reference package, errors."""

from __future__ import annotations

import datetime
from typing import Any

import numpy as np
import pytest
from dm_env_rpc.v1 import tensor_utils as reference
from google.protobuf import any_pb2, struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dm_env_rpc_client import errors, tensors
from dm_env_rpc_client._proto import dm_env_rpc_pb2

Tensor = dm_env_rpc_pb2.Tensor

DataType = dm_env_rpc_pb2.DataType
NUMERIC = [np.float32, np.float64, np.int8, np.int32, np.int64, np.uint8, np.uint32, np.uint64]


def _wire(tensor: dm_env_rpc_pb2.Tensor) -> bytes:
    return tensor.SerializeToString(deterministic=True)


def _arrays(dtype: type) -> st.SearchStrategy[np.ndarray]:
    shapes = hnp.array_shapes(min_dims=0, max_dims=5, min_side=0, max_side=4)
    if np.dtype(dtype).kind == "f":
        elements = st.floats(width=np.finfo(dtype).bits, allow_nan=False)
        return hnp.arrays(dtype, shapes, elements=elements)
    return hnp.arrays(dtype, shapes)


@settings(max_examples=40, derandomize=True, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([*NUMERIC, np.bool_]))
def test_round_trip_numeric(data: st.DataObject, dtype: type) -> None:
    value = data.draw(_arrays(dtype))
    tensor = tensors.pack_tensor(value)
    assert tensor.WhichOneof("payload") == tensors._PAYLOAD[tensors.np_type_to_data_type(dtype)][0]
    out = tensors.unpack_tensor(tensor)
    assert np.asarray(out).dtype == np.dtype(dtype)
    assert np.array_equal(out, value)
    if value.shape == ():
        assert isinstance(out, np.generic)
    assert _wire(tensor) == _wire(reference.pack_tensor(value))


@settings(max_examples=25, derandomize=True, deadline=None)
@given(
    value=hnp.arrays(
        np.str_,
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3),
        elements=st.text(max_size=5).filter(lambda s: "\x00" not in s),
    )
)
def test_round_trip_strings(value: np.ndarray) -> None:
    tensor = tensors.pack_tensor(value)
    out = tensors.unpack_tensor(tensor)
    if value.shape == ():
        assert isinstance(out, str) and out == value.item()
    else:
        assert out.shape == value.shape and out.tolist() == value.tolist()
    assert _wire(tensor) == _wire(reference.pack_tensor(value))


@settings(max_examples=30, derandomize=True, deadline=None)
@given(
    dtype=st.sampled_from(NUMERIC),
    shape=hnp.array_shapes(min_dims=1, max_dims=4, min_side=2, max_side=4),
)
def test_broadcast_round_trip(dtype: type, shape: tuple[int, ...]) -> None:
    value = np.full(shape, 3, dtype=dtype)
    tensor = tensors.pack_tensor(value, try_compress=True)
    assert list(tensor.shape) == list(shape)
    assert len(getattr(tensor, tensor.WhichOneof("payload")).array) == 1
    out = tensors.unpack_tensor(tensor)
    assert out.shape == shape and out.dtype == np.dtype(dtype) and np.all(out == 3)
    assert _wire(tensor) == _wire(reference.pack_tensor(value, try_compress=True))


@settings(max_examples=30, derandomize=True, deadline=None)
@given(
    shape=hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=4),
    axis=st.integers(0, 3),
)
def test_variable_dimension_is_inferred(shape: tuple[int, ...], axis: int) -> None:
    value = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    tensor = tensors.pack_tensor(value)
    tensor.shape[axis % len(shape)] = -1
    assert np.array_equal(tensors.unpack_tensor(tensor), value)


REFERENCE_CASES = [
    np.float32(1.5),
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.array([-1, 0, 1, 2**31 - 1, -(2**31)], np.int32),
    np.array([-(2**63), 2**63 - 1, 0, 300], np.int64),
    np.array([0, 2**32 - 1, 128, 16384], np.uint32),
    np.array([0, 2**64 - 1, 2**63], np.uint64),
    np.array([[True, False], [False, True]]),
    np.arange(-5, 5, dtype=np.int8),
    np.arange(200, dtype=np.uint8).reshape(10, 20),
    np.zeros((0, 3), np.float64),
    np.array([], np.int32),
    "hello",
    ["a", "bb", "ccc"],
    7,
    -7,
    2.25,
    True,
    [[1.0, 2.0], [3.0, 4.0]],
    np.arange(12, dtype=">f4").reshape(3, 4),  # big-endian
    np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4)),
    np.arange(24, dtype=np.int32).reshape(4, 6)[:, ::2],  # not contiguous
    np.asfortranarray(np.arange(12, dtype=np.uint8).reshape(3, 4)),
    np.arange(10, dtype=">i8")[::3],
    np.arange(12, dtype=np.int8).reshape(3, 4).T,
    # Payloads over 4 KB take the other way into the buffer.
    np.arange(2000, dtype=np.float32).reshape(40, 50),
    np.arange(1500, dtype=">f8"),
    np.arange(5000, dtype=np.uint8) % 251,
]


@pytest.mark.parametrize("value", REFERENCE_CASES, ids=repr)
def test_wire_bytes_equal_reference(value: object) -> None:
    tensor = tensors.pack_tensor(value)
    assert _wire(tensor) == _wire(reference.pack_tensor(value))
    assert np.array_equal(tensors.unpack_tensor(tensor), np.asarray(value))


@pytest.mark.parametrize(
    ("value", "dtype"),
    [
        ([1, 2, 3], np.float32),
        ([1, 2, 3], DataType.INT8),
        (np.arange(4, dtype=np.int64), np.uint32),
        (np.array([1.0, 2.0]), DataType.INT64),
        (np.float64(0.5), np.float32),
        ([True, False], np.int32),
    ],
)
def test_explicit_dtype_matches_reference(value: object, dtype: object) -> None:
    assert _wire(tensors.pack_tensor(value, dtype)) == _wire(reference.pack_tensor(value, dtype))


def test_protos_are_packed_into_any_and_any_stays_any() -> None:
    message = struct_pb2.Value(string_value="x")
    packed = any_pb2.Any()
    packed.Pack(struct_pb2.Value(number_value=2.0))
    tensor = tensors.pack_tensor([message, packed])
    out = tensors.unpack_tensor(tensor)
    assert out.dtype == object and all(isinstance(item, any_pb2.Any) for item in out)
    unpacked = struct_pb2.Value()
    assert out[0].Unpack(unpacked) and unpacked.string_value == "x"
    assert out[1] == packed
    scalar = tensors.unpack_tensor(tensors.pack_tensor(message))
    assert isinstance(scalar, any_pb2.Any)


def test_uint8_unpacks_read_only_view_and_float_writable() -> None:
    out = tensors.unpack_tensor(tensors.pack_tensor(np.arange(4, dtype=np.uint8)))
    assert not out.flags.writeable
    floats = tensors.unpack_tensor(tensors.pack_tensor(np.arange(4, dtype=np.float32)))
    assert floats.flags.writeable


def test_dtype_maps_are_inverse() -> None:
    for data_type, dtype in tensors.DATA_TYPE_TO_NUMPY.items():
        assert tensors.np_type_to_data_type(dtype) == data_type
        assert tensors.data_type_to_np_type(data_type) == dtype.type
    assert tensors.get_tensor_type(tensors.pack_tensor(np.float32(1))) is np.float32


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (np.zeros(3, np.float16), "float16.*astype\\(np.float32\\)"),
        (np.zeros(3, np.int16), "int16.*astype\\(np.int32\\)"),
        (np.zeros(3, np.uint16), "uint16"),
        (np.zeros(3, np.complex64), "complex"),
        (b"raw", "bytes.*decode"),
        (np.array([b"a"]), "decode bytes"),
        (np.array([np.datetime64("2024-01-01")]), "datetime"),
        (np.array([datetime.timedelta(1)], dtype="m8[s]"), "timedelta"),
    ],
)
def test_unsupported_dtypes(value: object, match: str) -> None:
    with pytest.raises(errors.UnsupportedDtypeError, match=match) as info:
        tensors.pack_tensor(value)
    assert isinstance(info.value, TypeError)


def test_object_arrays_must_be_all_str_or_all_messages() -> None:
    with pytest.raises(errors.TensorTypeError, match="element 1 is int"):
        tensors.pack_tensor(np.array(["a", 1], dtype=object))
    with pytest.raises(errors.TensorTypeError, match="element 1 is str"):
        tensors.pack_tensor(np.array([struct_pb2.Value(), "a"], dtype=object))
    with pytest.raises(errors.TensorTypeError, match="element 0 is int"):
        tensors.pack_tensor(np.array([1, 2], dtype=object), DataType.STRING)


def test_ragged_input() -> None:
    with pytest.raises(errors.RaggedArrayError, match="ragged") as info:
        tensors.pack_tensor([[1, 2], [3]])
    assert isinstance(info.value, ValueError)


def test_integers_that_do_not_fit_are_refused_unless_asked() -> None:
    with pytest.raises(errors.IntegerRangeError, match=r"int8.*\[300, 300\].*\[-128, 127\]"):
        tensors.pack_tensor([300], np.int8)
    with pytest.raises(errors.IntegerRangeError, match="uint32"):
        tensors.pack_tensor([-1], DataType.UINT32)
    assert tensors.unpack_tensor(tensors.pack_tensor([300], np.int8, on_overflow="wrap"))[0] == 44
    clipped = tensors.unpack_tensor(tensors.pack_tensor([300, -300], np.int8, on_overflow="clip"))
    assert clipped.tolist() == [127, -128]
    with pytest.raises(errors.TensorValueError, match="fractional"):
        tensors.pack_tensor([1.5], np.int32)
    with pytest.raises(ValueError, match="on_overflow"):
        tensors.pack_tensor([1], np.int8, on_overflow="saturate")  # type: ignore[arg-type]


def test_bad_dtype_argument() -> None:
    with pytest.raises(errors.UnsupportedDtypeError, match="Unknown dtype 99"):
        tensors.pack_tensor(1, 99)
    with pytest.raises(errors.UnsupportedDtypeError, match="INVALID|Unknown"):
        tensors.data_type_to_np_type(DataType.INVALID_DATA_TYPE)


def test_shape_errors() -> None:
    tensor = tensors.pack_tensor(np.arange(6, dtype=np.float32))
    tensor.shape[:] = [-1, -1]
    with pytest.raises(errors.ShapeError, match="more than one negative"):
        tensors.unpack_tensor(tensor)
    tensor.shape[:] = [4, -1]
    with pytest.raises(errors.ShapeError, match="6 element.*\\[4, -1\\]"):
        tensors.unpack_tensor(tensor)
    tensor.shape[:] = [4]
    with pytest.raises(errors.ShapeError, match="6 element.*\\[4\\]"):
        tensors.unpack_tensor(tensor)
    tensor.shape[:] = []
    with pytest.raises(errors.ShapeError, match="6 element"):
        tensors.unpack_tensor(tensor)


def test_tensor_without_payload() -> None:
    with pytest.raises(errors.EmptyTensorError, match="no payload"):
        tensors.unpack_tensor(dm_env_rpc_pb2.Tensor(shape=[2]))


def test_large_varints_round_trip_with_mixed_lengths() -> None:
    rng = np.random.default_rng(0)
    for dtype in (np.int32, np.int64, np.uint32, np.uint64):
        info = np.iinfo(dtype)
        value = rng.integers(info.min, info.max, 5000, dtype=dtype, endpoint=True)
        value[::7] = rng.integers(0, 200, value[::7].size)
        tensor = tensors.pack_tensor(value)
        assert np.array_equal(tensors.unpack_tensor(tensor), value)
        assert _wire(tensor) == _wire(reference.pack_tensor(value))


ALL_KINDS = [*NUMERIC, np.bool_, np.str_, object]


def _example(dtype: type, shape: tuple[int, ...]) -> np.ndarray:
    count = int(np.prod(shape))
    if dtype is np.str_:
        return np.array([f"s{i}" for i in range(count)], dtype=np.str_).reshape(shape)
    if dtype is object:
        flat = np.empty(count, dtype=object)
        for i in range(count):
            flat[i] = struct_pb2.Value(number_value=i)
        return flat.reshape(shape)
    return (
        (np.arange(count) % 2 if dtype is np.bool_ else np.arange(count))
        .astype(dtype)
        .reshape(shape)
    )


def _same(out: object, value: np.ndarray) -> bool:
    if value.dtype != object:
        return bool(np.array_equal(out, value))
    expected = np.empty(value.shape, dtype=object)
    for index, item in np.ndenumerate(value):
        packed = any_pb2.Any()
        packed.Pack(item)
        expected[index] = packed
    return bool(np.asarray(out).shape == value.shape) and all(
        a == b for a, b in zip(np.asarray(out).ravel(), expected.ravel(), strict=True)
    )


@settings(max_examples=60, derandomize=True, deadline=None)
@given(
    dtype=st.sampled_from(ALL_KINDS),
    shape=hnp.array_shapes(min_dims=0, max_dims=5, min_side=0, max_side=3),
    data=st.data(),
)
def test_every_dtype_round_trips_with_variable_and_broadcast_shapes(
    dtype: type, shape: tuple[int, ...], data: st.DataObject
) -> None:
    value = _example(dtype, shape)
    tensor = tensors.pack_tensor(value)
    assert _same(tensors.unpack_tensor(tensor), value)
    if dtype is not object:
        assert _wire(tensor) == _wire(reference.pack_tensor(value))
    if shape and value.size:  # a variable dimension is inferred from the count
        axis = data.draw(st.integers(0, len(shape) - 1))
        variable = dm_env_rpc_pb2.Tensor()
        variable.CopyFrom(tensor)
        variable.shape[axis] = -1
        assert _same(tensors.unpack_tensor(variable), value)
    if dtype is not object and value.size > 1:  # a broadcast of the first element
        full = np.full(shape, value.flat[0], dtype=value.dtype)
        compressed = tensors.pack_tensor(full, try_compress=True)
        assert len(getattr(compressed, compressed.WhichOneof("payload")).array) == 1
        assert np.array_equal(tensors.unpack_tensor(compressed), full)


def test_broadcast_needs_a_known_shape() -> None:
    tensor = tensors.pack_tensor(np.float32([1.0]))
    tensor.shape[:] = [-1, 3]
    with pytest.raises(errors.ShapeError, match="1 element"):
        tensors.unpack_tensor(tensor)
    tensor.shape[:] = [-1]
    assert tensors.unpack_tensor(tensor).shape == (1,)


def test_docs_examples_run() -> None:
    import pathlib
    import re

    path = pathlib.Path(__file__).parent.parent / "docs" / "tensors.md"
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
    assert len(blocks) >= 6
    for index, block in enumerate(blocks):
        exec(compile(block, f"{path.name}[{index}]", "exec"), {})


@pytest.mark.parametrize(
    "value",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.arange(2000, dtype=np.float32).reshape(40, 50),
        np.arange(3, dtype=">f8"),
        np.array([-1, 2**31 - 1], np.int32),
        np.arange(5, dtype=np.uint8),
        np.array([True, False]),
        np.float64(2.5),
        "text",
        np.array(["a", "b"]),
    ],
    ids=repr,
)
def test_tensor_wire_bytes_parse_to_the_packed_tensor(value: object) -> None:
    wire = tensors.tensor_wire_bytes(value)
    assert dm_env_rpc_pb2.Tensor.FromString(bytes(wire)) == tensors.pack_tensor(value)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8, np.uint8])
def test_stack_tensors_joins_fixed_width_payloads(dtype: Any) -> None:
    rng = np.random.default_rng(3)
    arrays = [(rng.random((2, 3)) * 100).astype(dtype) for _ in range(4)]
    items = [Tensor.FromString(tensors.pack_tensor(a).SerializeToString()) for a in arrays]
    data_type = tensors.np_type_to_data_type(np.dtype(dtype))
    stacked = tensors.stack_tensors(items, data_type, (2, 3))
    assert stacked is not None and stacked.dtype == np.dtype(dtype) and stacked.flags.writeable
    np.testing.assert_array_equal(stacked, np.stack(arrays))


def test_stack_tensors_declines_what_it_cannot_join() -> None:
    floats = tensors.np_type_to_data_type(np.dtype(np.float32))
    two = [tensors.pack_tensor(np.zeros((2,), np.float32)) for _ in range(2)]
    assert tensors.stack_tensors(two, floats, (3,)) is None  # another shape
    assert tensors.stack_tensors(two, floats, (-1,)) is None  # a variable dimension
    broadcast = Tensor(floats=Tensor.FloatArray(array=[1.0]), shape=[2])
    assert tensors.stack_tensors([broadcast], floats, (2,)) is None  # one element for two
    ints = [tensors.pack_tensor(np.zeros((2,), np.int32))]
    int32 = tensors.np_type_to_data_type(np.dtype(np.int32))
    assert tensors.stack_tensors(ints, int32, (2,)) is None  # varint payloads: one by one
    assert tensors.stack_tensors(ints, floats, (2,)) is None  # the wrong payload field
    scalars = [tensors.pack_tensor(np.float32(v)) for v in (1.5, -2.0)]
    np.testing.assert_array_equal(tensors.stack_tensors(scalars, floats, ()), [1.5, -2.0])


@pytest.mark.parametrize("value", [0, 7, -3, 2**63 - 1, -(2**63), 2**63, np.int64(5)])
def test_a_python_int_packs_as_the_array_path_packs_it(value: int) -> None:
    """``pack_tensor``'s shortcut for a Python int (each world's seed) makes the message the
    general path makes (an array's), and checks ``on_overflow`` as that path does."""
    assert tensors.pack_tensor(value) == tensors.pack_tensor(np.asarray(value))
    assert tensors.pack_tensor(value, try_compress=True) == tensors.pack_tensor(value)
    with pytest.raises(errors.ArgumentValueError, match="on_overflow"):
        tensors.pack_tensor(value, on_overflow="saturate")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "value",
    [
        np.int64(-5),
        np.int64(2**63 - 1),
        np.int64(-(2**63)),
        np.int32(7),
        np.uint64(2**64 - 1),
        np.uint32(3),
        np.float64(0.1),
        np.float32(0.1),
        np.bool_(True),
        np.bool_(False),
        np.int8(-1),
    ],
    ids=repr,
)
def test_a_scalar_unpacks_to_what_the_general_decoder_gives(value: Any) -> None:
    """``unpack_tensor`` reads a one-element shape-[] Tensor (a seed, a setting) straight from
    the message; the value (type, dtype, bits) is the general decoder's: the same payload
    with shape [1], its element."""
    packed = tensors.pack_tensor(value)
    assert not packed.shape
    scalar = tensors.unpack_tensor(packed)
    shaped = dm_env_rpc_pb2.Tensor()
    shaped.CopyFrom(packed)
    shaped.shape.append(1)
    general = tensors.unpack_tensor(shaped)[0]
    assert type(scalar) is type(general)
    assert scalar.dtype == general.dtype
    assert np.asarray(scalar).tobytes() == np.asarray(general).tobytes()


def test_a_shapeless_tensor_of_two_elements_is_still_refused() -> None:
    two = dm_env_rpc_pb2.Tensor(int64s=dm_env_rpc_pb2.Tensor.Int64Array(array=[1, 2]))
    with pytest.raises(errors.ShapeError):
        tensors.unpack_tensor(two)
