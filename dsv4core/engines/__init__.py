"""Engine adapters: dsv4core's model run by a serving engine that owns the request state memory.

An adapter sits above the model core (`dsv4core.model`), which names no engine: it describes the
model's caches in the engine's terms, views the memory the engine allocated as dsv4core pools,
and builds the model's per-step metadata (`dsv4core.model.step.Step`) from the engine's block
tables. `dsv4core.engines.vllm`: vLLM.
"""
