"""vllm-wna16-plugin: weight-only int4/int8 MoE checkpoints on vLLM, without crashes, faster.

`register()` is the `vllm.general_plugins` entry point: vLLM calls it in every
process it starts. It is idempotent and cheap (vLLM internals are imported
lazily by `_vllm.py`), and raises a clear error on an unsupported vLLM.
"""

from __future__ import annotations

__version__ = "0.1.0"

_REGISTERED = False


def register() -> None:
    """Register the `moe_wna16_plus` quantization method with vLLM (safe to call many times)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from vllm_wna16_plugin import _vllm
    from vllm_wna16_plugin.quant_config import QUANTIZATION_NAME, make_config_class

    _vllm.check_vllm_version()
    _vllm.register_quantization_config(QUANTIZATION_NAME, make_config_class())
    _REGISTERED = True
    _vllm.init_logger(__name__).debug("vllm-wna16-plugin %s registered %s", __version__, QUANTIZATION_NAME)


__all__ = ["__version__", "register"]
