"""jaxreshard: pipeline-parallel JAX training across device meshes with optimised resharding."""

__version__ = "0.1.0"
