"""The driver's side of a step, the same for every runtime."""
