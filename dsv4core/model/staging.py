"""Host -> device copies that do not make the host wait for the device.

A blocking copy from host memory returns only once the device has run everything queued before
it, so a step that uploads its metadata that way cannot be prepared while the previous step still
runs. `Uploads` stages each copy in page-locked memory and queues it (`non_blocking`): it runs in
stream order (after the work queued before it, before the work queued after it) and the host goes
on at once. torch's page-locked allocator keeps a staging buffer from reuse until the copy that
reads it has run (a non_blocking copy records an event on it: checked in torch's GPU copy
path; other devices' allocators are expected to do the same), and the host values are
copied into the staging buffer before the call returns, so they may change right after it.
Freed staging buffers stay in torch's page-locked cache (about one step's inputs per step in
flight).

Device-neutral: page-locked memory comes from torch's generic allocator; on the CPU, or where
page-locked memory cannot be had, a copy is a plain blocking one.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

log = logging.getLogger("dsv4core.model")


class Uploads:
    """Queued host -> device copies through page-locked staging (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.queued = self.device.type != "cpu"     # False: blocking copies

    def copy(self, dst: torch.Tensor, src: np.ndarray) -> None:
        """dst (a device tensor) <- src (host numpy, dst's dtype and number of elements), queued."""
        host = torch.from_numpy(np.ascontiguousarray(src))
        if host.dtype != dst.dtype or host.numel() != dst.numel():
            raise ValueError(f"upload: host {host.dtype} x {host.numel()} into {dst.dtype} x {dst.numel()}")
        host = host.view(dst.shape)
        if self.queued:
            try:
                staged = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
            except RuntimeError as e:                # no page-locked memory for this device
                log.info("uploads: blocking host->device copies (%s)", e)
                self.queued = False
            else:
                staged.copy_(host)
                dst.copy_(staged, non_blocking=True)
                return
        dst.copy_(host)

    def to_device(self, src: np.ndarray) -> torch.Tensor:
        """A new device tensor holding src (queued copy)."""
        src = np.ascontiguousarray(src)
        dst = torch.empty(src.shape, dtype=torch.from_numpy(src).dtype, device=self.device)
        self.copy(dst, src)
        return dst
