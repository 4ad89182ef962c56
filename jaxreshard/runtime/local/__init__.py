"""The local runtime: every stage on this process's devices."""
