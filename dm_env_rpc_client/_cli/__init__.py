"""Beneath cli: the command line's argument types and its run, check and record pieces."""
