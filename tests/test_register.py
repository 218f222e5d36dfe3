"""Registration through vLLM's real plugin loader, idempotency, and the version guard."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vllm_wna16_plugin import _vllm


def test_entry_point_registers_through_load_general_plugins():
    code = (
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config\n"
        "assert 'moe_wna16_plus' in QUANTIZATION_METHODS, QUANTIZATION_METHODS\n"
        "cls = get_quantization_config('moe_wna16_plus')\n"
        "print(cls.get_name())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "moe_wna16_plus"


def test_register_is_idempotent():
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    import vllm_wna16_plugin

    vllm_wna16_plugin.register()
    vllm_wna16_plugin.register()
    assert QUANTIZATION_METHODS.count("moe_wna16_plus") == 1


def test_import_is_cheap():
    code = "import sys, vllm_wna16_plugin; print(any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", "importing the plugin must not import vLLM"


@pytest.mark.parametrize("version", ["0.25.2", "0.27.0", "1.0.0"])
def test_unsupported_vllm_version_is_a_clear_error(version):
    with pytest.raises(RuntimeError, match=rf"supports vLLM >= 0\.26, < 0\.27; found vLLM {version}"):
        _vllm.check_vllm_version(version)


def test_supported_vllm_version_passes():
    _vllm.check_vllm_version("0.26.0")
    _vllm.check_vllm_version("0.26.3.post1")


def test_plugin_info_logs_reach_vllms_handler():
    # `vllm serve` showed no backend explanation: a logger outside `vllm.` drops INFO (root's last resort)
    code = (
        "from vllm_wna16_plugin import moe_method\n"
        "from vllm_wna16_plugin.kernels.triton import td_gate\n"
        "moe_method.logger.info('explained-by-the-method')\n"
        "td_gate.logger.info('explained-by-the-gate')\n"
    )
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO", "VLLM_CONFIGURE_LOGGING": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    log = out.stdout + out.stderr
    assert "explained-by-the-method" in log and "explained-by-the-gate" in log, log[-2000:]
    assert "INFO" in log.split("explained-by-the-method")[0].splitlines()[-1], "not vLLM's format"
