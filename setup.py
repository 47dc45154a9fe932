"""Packaging for dm_env_rpc_client. Tool configuration lives in pyproject.toml."""

import pathlib

import setuptools

ROOT = pathlib.Path(__file__).parent

# Floors: the generated code (grpcio-tools 1.70.0, protobuf gencode 5.29.0)
# needs grpcio >= 1.70.0 and protobuf >= 5.29.0 at run time (5.29.0 itself
# is yanked, so the floor is 5.29.1). tests/test_floors.py
# installs exactly these floors into a fresh virtual environment and runs a
# round trip against the embedded server.
INSTALL_REQUIRES = [
    "grpcio>=1.70.0",
    "protobuf>=5.29.1",
    "numpy>=1.24.0",
    "dm-env>=1.6",
    "dm-tree>=0.1.8",
    "googleapis-common-protos>=1.63.2",
    "tqdm>=4.60",
]

TEST_REQUIRES = [
    "pytest>=8",
    "pytest-timeout>=2.3",
    "hypothesis>=6.100",
    # Pinned exactly: tests/test_protos.py regenerates the committed code and
    # compares byte for byte.
    "grpcio-tools==1.70.0",
    "mypy-protobuf==3.6.0",
    "ruff==0.17.6",
    "mypy>=1.10",
    "types-protobuf",
    # Test-only interoperability peer; the library never imports it.
    "dm-env-rpc==1.1.7",
    # A throwaway certificate authority for the TLS tests.
    "trustme>=1.1",
]

# Jupyter use: a kernel and plots for docs/quickstart.ipynb.
NOTEBOOK_REQUIRES = [
    "ipykernel>=6.0",
    "ipywidgets>=8.0",
    "matplotlib>=3.5",
    "nbclient>=0.7",
    "nbformat>=5.0",
]

# The documentation site: mkdocs build --strict (tests/test_mkdocs.py).
DOCS_REQUIRES = ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"]

# Server fleets and sharded stepping on Ray (dm_env_rpc_client.integrations.ray).
# Tested with Ray 2.60.0.
RAY_REQUIRES = ["ray>=2.40"]

# dm_env_rpc_client.integrations.gymnasium; 1.2.2 is the version RLlib pins.
GYMNASIUM_REQUIRES = ["gymnasium>=1.2.2"]

# RLlib's env creator (integrations.ray.rllib_env_creator): RLlib over the gymnasium bridge.
RLLIB_REQUIRES = ["ray[rllib]>=2.40", *GYMNASIUM_REQUIRES]

# The training tier (pytest -m training): learners on top of the integrations. torch is
# not listed: .ci/run installs torch==2.13.0 (the CPU build) first, which these then use.
TRAINING_REQUIRES = [*GYMNASIUM_REQUIRES, "stable-baselines3>=2.4", *RLLIB_REQUIRES]
# TorchRL over the gymnasium bridge (tests/test_gym_torchrl.py); both resolve beside torch==2.13.0.
TRAINING_REQUIRES += ["torchrl==0.14.1", "tensordict==0.14.3"]

# The tests run the notebook, build the site, run the Ray tests (a local Ray, about 20 s)
# and drive the gymnasium bridge.
TEST_REQUIRES += NOTEBOOK_REQUIRES + DOCS_REQUIRES + RAY_REQUIRES + GYMNASIUM_REQUIRES
# Minari's own DataCollector checks the gymnasium bridge's infos (tests/test_gym_defects.py).
TEST_REQUIRES += ["minari[hdf5]==0.5.4"]

setuptools.setup(
    name="dm_env_rpc_client",
    version="0.1.0",
    description="A fast, dependable Python client SDK for dm_env_rpc environments.",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=setuptools.find_packages(include=["dm_env_rpc_client", "dm_env_rpc_client.*"]),
    package_data={"dm_env_rpc_client": ["py.typed", "_proto/*.pyi"]},
    install_requires=INSTALL_REQUIRES,
    extras_require={
        "test": TEST_REQUIRES,
        "notebook": NOTEBOOK_REQUIRES,
        "docs": DOCS_REQUIRES,
        "ray": RAY_REQUIRES,
        "rllib": RLLIB_REQUIRES,
        "gymnasium": GYMNASIUM_REQUIRES,
        "training": TRAINING_REQUIRES,
    },
    entry_points={"console_scripts": ["dm-env-rpc-client=dm_env_rpc_client.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Typing :: Typed",
    ],
)
