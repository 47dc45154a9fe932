"""Bridges from dm_env_rpc_client to optional third-party libraries.

Each module here needs an extra, and importing it without that extra raises an
``ImportError`` that names the extra to install. The core package never imports
this folder.

- ``gymnasium``: a world as a ``gymnasium.Env``, many worlds as a
  ``gymnasium.vector.VectorEnv`` (``pip install 'dm_env_rpc_client[gymnasium]'``).
- ``ray``: server fleets as Ray actors and sharded stepping (``[ray]``).
"""
