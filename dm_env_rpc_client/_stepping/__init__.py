"""The stepping loop's machinery (``dmr.collect``; the public names are in ``stepping``)."""
