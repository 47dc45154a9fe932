"""What every layer uses: the entry points' argument checks, gRPC's log level."""
