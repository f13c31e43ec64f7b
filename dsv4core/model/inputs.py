"""What a step takes as request input: the errors for bad input, integer vectors checked on the
host, and token ids that stay on the device (`DeviceTokens`)."""

from __future__ import annotations

import numpy as np
import torch


class InputError(ValueError):
    """Bad request input (out-of-vocabulary id, empty prompt, too long, malformed batch)."""


def _host_long(a, what: str = "argument") -> np.ndarray:
    """A 1-D int64 numpy vector (host metadata) from a 1-D integer list / tensor (one copy if the
    tensor lives on a device). Floats and other shapes are refused, not rounded or flattened."""
    t = a if isinstance(a, torch.Tensor) else torch.as_tensor(a)
    if t.numel() and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
        raise InputError(f"{what} must hold integers; got dtype {str(t.dtype).removeprefix('torch.')}")
    if t.dim() != 1 and not (t.numel() == 0 and t.dim() <= 1):
        raise InputError(f"{what} must be 1-D (flattened tokens); got shape {tuple(t.shape)}")
    if t.dtype != torch.int64 or t.device.type != "cpu":
        t = t.to("cpu", torch.int64)
    return t.reshape(-1).numpy()      # integer tensors carry no gradient: no detach needed


class DeviceTokens:
    """Token ids that stay on the model's device, made by `model.greedy_tokens(logits)` only (the
    argmax of each logits row, so every id is in [0, vocab) by construction; their values are
    not checked again). `forward_batch` takes them as `input_ids` without reading them back: the
    host never waits for the step that produced them, so the next step is queued while that one
    still runs (an engine's async decode). `tolist()` reads them (that waits)."""

    __slots__ = ("tensor", "vocab")

    def __init__(self, tensor: torch.Tensor, vocab: int) -> None:
        self.tensor, self.vocab = tensor, vocab

    def __len__(self) -> int:
        return self.tensor.shape[0]

    def tolist(self) -> list[int]:
        return self.tensor.tolist()

    def __repr__(self) -> str:
        return f"DeviceTokens({len(self)} ids on {self.tensor.device})"
