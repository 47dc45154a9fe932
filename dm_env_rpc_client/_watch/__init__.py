"""Beneath watch: the watcher's tally and frames, its HTTP server, its events and its page."""
