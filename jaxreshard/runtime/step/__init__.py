"""Compiling and laying out a step: stage executables, specs, transfer plans, programs."""
