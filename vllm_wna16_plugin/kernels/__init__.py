"""Kernels of the plugin: Triton (pointer + tensor-descriptor paths) and helpers.

Nothing under `kernels/` imports vLLM; callers pass vLLM's ops in (e.g. `align_fn`).
"""
