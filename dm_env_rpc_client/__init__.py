"""dm_env_rpc_client."""
