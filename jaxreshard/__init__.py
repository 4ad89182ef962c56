"""jaxreshard: pipeline-parallel JAX training across device meshes with optimised resharding.

Attributes load lazily, so that `import jaxreshard` (and the CLI) stays quick and the pure
parts (`jaxreshard.pipeline`) work without importing JAX.
"""

from __future__ import annotations

from jaxreshard._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "parallelize": "jaxreshard._parallelize",
    "PipelineConfig": "jaxreshard.runtime._config",
    "stage_boundary": "jaxreshard.frontend",
    "stage_candidate": "jaxreshard.frontend",
    "scan": "jaxreshard.frontend",
    "grad": "jaxreshard.frontend",
    "value_and_grad": "jaxreshard.frontend",
    "filter_grad": "jaxreshard.frontend",
    "filter_value_and_grad": "jaxreshard.frontend",
    "collect": "jaxreshard._state",
    "PipelineSplitError": "jaxreshard.frontend",
    "MicroBatchWarning": "jaxreshard.frontend",
    "BatchArgnumsWarning": "jaxreshard._arguments",
    "PipelineError": "jaxreshard.runtime.engine._events",
    "RuntimeBroken": "jaxreshard.runtime.ray._wait",
    "ReplicatedSpecWarning": "jaxreshard.runtime.step._specs",
    "ScheduleError": "jaxreshard.pipeline._simulate",
    "OrderError": "jaxreshard.comm._order",
    "reshard": "jaxreshard._reshard",
    "init": "jaxreshard.runtime._api",
    "shutdown": "jaxreshard.runtime._api",
    "current_runtime": "jaxreshard.runtime._api",
    "RemoteArray": "jaxreshard.runtime.ray._remote",
    "RemoteStruct": "jaxreshard.runtime.ray._remote",
    "save_checkpoint": "jaxreshard.checkpoint",
    "restore_checkpoint": "jaxreshard.checkpoint",
    "checkpoint_metadata": "jaxreshard.checkpoint",
    "CheckpointError": "jaxreshard.checkpoint",
    "PendingCheckpoint": "jaxreshard.checkpoint",
    "train_elastic": "jaxreshard._elastic",
    "Cluster": "jaxreshard.comm",
    "VirtualMesh": "jaxreshard.comm",
    "VirtualSharding": "jaxreshard.comm",
    "plan_reshard": "jaxreshard.comm",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
