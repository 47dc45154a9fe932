"""``python -m dm_env_rpc_client``: the same as the ``dm-env-rpc-client`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
