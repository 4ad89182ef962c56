"""Checkpoints that restore into any layout (see [Note: checkpoint format] in `_format.py`)."""

from jaxreshard.checkpoint._format import CheckpointError
from jaxreshard.checkpoint._restore import checkpoint_metadata, restore_checkpoint
from jaxreshard.checkpoint._save import PendingCheckpoint, save_checkpoint

__all__ = [
    "CheckpointError",
    "PendingCheckpoint",
    "checkpoint_metadata",
    "restore_checkpoint",
    "save_checkpoint",
]
