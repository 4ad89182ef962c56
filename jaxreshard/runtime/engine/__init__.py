"""The host engine: one process's part of a step (interpreter, channels, completion)."""
