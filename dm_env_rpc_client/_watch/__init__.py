"""Beneath watch: the watcher's tally and frames, its HTTP server, and its page."""
