"""Small helpers shared by CLI subcommands: tables, JSON output, the device check."""

from __future__ import annotations

import json
import sys
from typing import Any

from dsv4core._table import print_table  # noqa: F401  (re-exported for the commands)


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def check_device(text: str, option: str = "--device") -> str:
    """A usage error (ValueError: exit 2, one line) for a device string torch cannot parse or a
    device this machine does not have, before any model or op runs on it."""
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{option} {text!r} is not a torch device ({str(e).splitlines()[0]})") from None
    if dev.type in ("cpu", "meta"):
        return text
    mod = getattr(torch, dev.type, None)
    probe = getattr(mod, "is_available", None)
    if probe is not None and not probe():
        build = f" (torch {torch.__version__})"
        raise ValueError(f"{option} {text}: no {dev.type} device is available on this machine{build}")
    count = getattr(mod, "device_count", None)
    if dev.index is not None and count is not None and dev.index >= count():
        raise ValueError(f"{option} {text}: this machine has {count()} {dev.type} device(s)")
    return text
