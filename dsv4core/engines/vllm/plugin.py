"""The `vllm.general_plugins` entry point (`dsv4core[vllm]`): registers dsv4core's model for the
`DeepseekV4ForCausalLM` architecture, replacing vLLM's own (vLLM keys its DeepSeek-V4 settings on
that name, which the registration keeps). vLLM calls `register` in every process it starts."""

from __future__ import annotations

ARCHITECTURE = "DeepseekV4ForCausalLM"
MODEL_CLASS = "dsv4core.engines.vllm.model:DeepseekV4ForCausalLM"


def register() -> None:
    """Register the model with vLLM's `ModelRegistry` (lazily, by name: importing the class, and
    so torch's device runtime, waits until vLLM builds the model)."""
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
