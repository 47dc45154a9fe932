"""Bridge defects third-party checkers found (issue 26): each test failed before its fix."""

from __future__ import annotations

import pathlib
import warnings

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import dm_env_rpc_client as dmr
from dm_env_rpc_client import errors
from dm_env_rpc_client.integrations import gymnasium as dgym
from dm_env_rpc_client.integrations.gymnasium import GymnasiumEnv
from dm_env_rpc_client.server import Server

_SUPPORTED = {np.dtype(dtype) for dtype in dmr.DATA_TYPE_TO_NUMPY.values()}
_SCALARS = sorted({t for t in np.sctypeDict.values()}, key=lambda t: t.__name__)


@pytest.mark.parametrize("scalar", _SCALARS, ids=lambda t: t.__name__)
def test_every_numpy_scalar_type_alias_packs_or_is_refused_by_name(scalar: type) -> None:
    dtype = np.dtype(scalar)
    if dtype.kind not in "biuf":
        return  # str, bytes, objects, dates, complex, void: not numeric aliases
    value = np.ones((), dtype)
    if dtype in _SUPPORTED:
        tensor = dmr.pack_tensor(value)
        assert dmr.unpack_tensor(tensor).dtype == dtype
        assert dmr.np_type_to_data_type(scalar) == dmr.np_type_to_data_type(dtype)
        return
    with pytest.raises(errors.UnsupportedDtypeError) as info:
        dmr.pack_tensor(value)
    # The message names the refused dtype and its NumPy type, and never a supported one.
    assert f"numpy.{scalar.__name__}" in str(info.value)
    assert f"dtype {dtype} " in str(info.value)


@pytest.mark.parametrize(
    ("scalar", "field"),
    [
        (np.ulonglong, "uint64s"),
        (np.longlong, "int64s"),
        (np.intc, "int32s"),
        (np.uintc, "uint32s"),
        (np.int_, "int64s"),
        (np.uint, "uint64s"),
        (np.byte, "int8s"),
        (np.ubyte, "uint8s"),
        (np.single, "floats"),
        (np.double, "doubles"),
    ],
)
def test_named_aliases_pack_as_their_dtype(scalar: type, field: str) -> None:
    assert dmr.pack_tensor(scalar(7)).WhichOneof("payload") == field
    assert dmr.pack_tensor(np.array([7, 8], scalar)).WhichOneof("payload") == field


def test_an_int_seed_of_2_63_or_more_packs_and_seeds_a_reset(catch_server: Server) -> None:
    tensor = dmr.pack_tensor(2**63 + 5)  # NumPy makes it a ulonglong
    assert tensor.WhichOneof("payload") == "uint64s" and dmr.unpack_tensor(tensor) == 2**63 + 5
    for refused in (np.half(1), np.longdouble(1), np.short(1), np.ushort(1)):
        with pytest.raises(errors.UnsupportedDtypeError, match=type(refused).__name__):
            dmr.pack_tensor(refused)
    env = GymnasiumEnv(address=catch_server.address)
    first, _ = env.reset(seed=2**63 + 5)
    again, _ = env.reset(seed=2**63 + 5)
    np.testing.assert_array_equal(first["board"], again["board"])
    env.close()


def test_check_env_of_a_made_env_without_an_image(catch_server: Server) -> None:
    env = gymnasium.make(dgym.ENV_ID, address=catch_server.address)
    assert env.metadata["render_modes"] == []
    check_env(env.unwrapped)  # renders every mode metadata offers: none here
    env.close()
    # The class still admits rgb_array for worlds that have an image.
    assert GymnasiumEnv.metadata["render_modes"] == ["rgb_array"]


def test_reset_and_step_infos_have_the_same_keys(catch_server: Server) -> None:
    env = GymnasiumEnv(address=catch_server.address, create_world_settings={"rows": 3})
    _, info = env.reset(seed=0)
    keys = [set(info)]
    for _ in range(3):  # through the end of an episode and the step that starts the next
        keys.append(set(env.step({"paddle": np.int8(0)})[4]))
    assert keys == [{dgym.DISCOUNT_KEY}] * 4
    env.close()


def test_torchrl_style_actions_bare_value_and_scalar_as_shape_1(catch_server: Server) -> None:
    env = GymnasiumEnv(address=catch_server.address, create_world_settings={"rows": 3})
    env.reset(seed=0)
    _, _, _, _, info = env.step(np.array([1], np.int8))  # one-key Dict unwrapped, scalar [1]
    assert info == {dgym.DISCOUNT_KEY: 1.0}
    env.step({"paddle": np.array([-1], np.int8)})
    with pytest.raises(errors.SpecValidationError):
        env.step({"paddle": np.array([1, 1], np.int8)})  # not a scalar: still refused
    env.close()


def test_rllib_creator_names_the_missing_setting(catch_server: Server) -> None:
    pytest.importorskip("ray")
    from dm_env_rpc_client.integrations.ray import rllib_env_creator

    config = {"addresses": [catch_server.address], "worker_index": 0, "unwrap_single": True}
    with pytest.raises(ValueError, match="gym_env_vectorize_mode=.*VECTOR_ENTRY_POINT"):
        rllib_env_creator(config)  # RLlib's per-env creator call: no num_envs
    with pytest.raises(ValueError, match="num_envs must be a positive int"):
        rllib_env_creator({**config, "num_envs": 0})
    with pytest.raises(ValueError, match=r"2-D.*FlattenObservations.*connector_flattens=True"):
        rllib_env_creator({**config, "num_envs": 2})  # Catch's board: Box((10, 5))
    envs = rllib_env_creator({**config, "num_envs": 2, "connector_flattens": True})
    assert envs.single_observation_space.shape == (10, 5)
    envs.close()


def test_minari_data_collector_records_infos(
    catch_server: Server, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    minari = pytest.importorskip("minari")
    pytest.importorskip("h5py")
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path))
    env = GymnasiumEnv(address=catch_server.address, create_world_settings={"rows": 3})
    collector = minari.DataCollector(env, record_infos=True)
    collector.reset(seed=1)
    collector.action_space.seed(0)
    for _ in range(8):  # four episodes of two steps
        _, _, terminated, truncated, _ = collector.step(collector.action_space.sample())
        if terminated or truncated:
            collector.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Minari's reminders to name an author and a permalink
        dataset = collector.create_dataset(dataset_id="dmr/catch-v0", algorithm_name="random")
    assert (dataset.total_episodes, dataset.total_steps) == (4, 8)
    episode = next(iter(dataset.iterate_episodes()))
    # The reset's info and each step's, with the same keys: discount 1.0, then 0.0 at the end.
    assert episode.infos["discount"].tolist() == [1.0, 1.0, 0.0]
    collector.close()
