"""Beneath conformance and recording: the conformance checks and probe, the episode stream, .npz files and the background episode writers (thread, process)."""
