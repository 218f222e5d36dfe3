"""MoE backends, one thin adapter each; `registry()` lists them in `auto`'s order of preference."""

from __future__ import annotations

from vllm_wna16_plugin.backends.base import Backend, KernelTensors, MoEProblem, RunOptions


def registry() -> dict[str, Backend]:
    """Every backend by its plugin name, in the order `auto` tries them."""
    from vllm_wna16_plugin.backends.cuda import CudaBackend
    from vllm_wna16_plugin.backends.hopper import HopperBackend
    from vllm_wna16_plugin.backends.humming import HummingBackend
    from vllm_wna16_plugin.backends.marlin import MarlinBackend
    from vllm_wna16_plugin.backends.reference import ReferenceBackend
    from vllm_wna16_plugin.backends.triton import TritonBackend
    from vllm_wna16_plugin.backends.vllm_cuda import VllmCudaBackend

    # cuda first: auto takes it only on a measured crossover, and it hands larger batches to triton.
    # hopper runs under auto only beside cuda / triton (its rule, launch_plan), alone when named.
    # humming (vLLM 0.33-0.34's default on sm90) is a peer to delegate to when asked, after marlin.
    backends = [
        CudaBackend(),
        TritonBackend(),
        HopperBackend(),
        MarlinBackend(),
        HummingBackend(),
        VllmCudaBackend(),
        ReferenceBackend(),
    ]
    return {b.name: b for b in backends}


__all__ = ["Backend", "KernelTensors", "MoEProblem", "RunOptions", "registry"]
