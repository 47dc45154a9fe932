"""Generated protobuf modules for dm_env_rpc v1. Do not edit.

Produced by ``scripts/gen_protos.py`` from ``protos/``.
"""
