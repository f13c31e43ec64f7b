"""The `vllm.general_plugins` entry point: registers dsv4core's model for the
`DeepseekV4ForCausalLM` architecture, replacing vLLM's own (vLLM keys its DeepSeek-V4 settings on
that name, which the registration keeps), when the environment variable DSV4CORE_VLLM is "1".

The entry point is installed with dsv4core, and vLLM calls it in every process it starts, so the
switch keeps an installed dsv4core from replacing vLLM's DeepSeek-V4 unasked."""

from __future__ import annotations

import os

ARCHITECTURE = "DeepseekV4ForCausalLM"
MODEL_CLASS = "dsv4core.engines.vllm.model:DeepseekV4ForCausalLM"
SWITCH = "DSV4CORE_VLLM"


def register(force: bool = False) -> bool:
    """Register the model with vLLM's `ModelRegistry` when DSV4CORE_VLLM=1 (or `force`); lazily,
    by name, so the class (and torch's device runtime) is imported only when vLLM builds the
    model. Returns whether it registered."""
    if not force and os.environ.get(SWITCH) != "1":
        return False
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    return True
