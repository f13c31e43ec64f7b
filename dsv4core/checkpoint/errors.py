"""Checkpoint integrity errors: every one names the tensor and the file it concerns."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded as it is.

    ``tensor`` is the tensor name the problem concerns (checkpoint name, or the module's
    parameter name when the checkpoint lacks it), ``file`` the shard (or index) involved.
    Both are repeated in the message.
    """

    def __init__(self, message: str, *, tensor: str | None = None, file: str | None = None):
        parts = []
        if tensor is not None:
            parts.append(f"tensor {tensor!r}")
        if file is not None:
            parts.append(f"file {str(file)!r}")
        prefix = (", ".join(parts) + ": ") if parts else ""
        super().__init__(prefix + message)
        self.tensor = tensor
        self.file = None if file is None else str(file)
        self.reason = message
