"""Beneath launch: one launched server process."""
