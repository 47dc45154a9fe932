"""Beneath batched: the batch's loop side, its opening, resets, restarts and balance."""
