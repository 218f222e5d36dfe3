"""vllm-wna16-plugin: weight-only int4/int8 MoE checkpoints on vLLM, without crashes, faster.

`register()` is the `vllm.general_plugins` entry point: vLLM calls it in every process it
starts, whether or not that process asks for `moe_wna16_plus`, and does not catch what it
raises. So it never raises: on a vLLM older than the plugin supports it logs one error and
registers a stand-in that refuses `moe_wna16_plus` with a ValueError saying why; on a vLLM
newer than the newest tested one it warns and registers. It is idempotent and cheap (vLLM
internals are imported lazily by `_vllm.py`).
"""

from __future__ import annotations

__version__ = "0.2.0"

_REGISTERED = False


def register() -> None:
    """Register the `moe_wna16_plus` quantization method with vLLM (safe to call many times; never raises)."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True  # one attempt per process: a failure is logged once, not at every call
    import logging

    try:
        from vllm_wna16_plugin import _vllm

        logger = _vllm.init_logger(__name__)
        status = _vllm.version_status()
        from vllm_wna16_plugin.quant_config import QUANTIZATION_NAME, make_config_class, make_refusal_class

        if not status.register:
            logger.error("%s", status.message)
            if status.version is not None:  # vLLM is there: asking for moe_wna16_plus says why it cannot work
                _vllm.register_quantization_config(QUANTIZATION_NAME, make_refusal_class(status.message))
            return
        if status.message:
            logger.warning("%s", status.message)
        _vllm.register_quantization_config(QUANTIZATION_NAME, make_config_class())
        logger.debug("vllm-wna16-plugin %s registered %s on vLLM %s", __version__, QUANTIZATION_NAME, status.version)
    except Exception as exc:  # noqa: BLE001 - a plugin must not take down vLLM runs that never use it
        logging.getLogger("vllm.vllm_wna16_plugin").error(
            "vllm-wna16-plugin %s could not register quantization 'moe_wna16_plus' (%s: %s); vLLM carries on "
            "without it. Please report this with your vLLM version.",
            __version__,
            type(exc).__name__,
            exc,
            exc_info=logging.getLogger("vllm").isEnabledFor(logging.DEBUG),
        )


__all__ = ["__version__", "register"]
