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


@pytest.mark.parametrize("version", ["0.25.2", "0.9.2", "0.20.0rc1"])
def test_older_vllm_is_refused_with_the_fix(version):
    status = _vllm.version_status(version)
    assert not status.register
    assert f"needs vLLM >= 0.26 and found vLLM {version}" in status.message
    assert "pip install 'vllm>=0.26,<0.35'" in status.message


@pytest.mark.parametrize("version", ["0.26.0", "0.26.3.post1", "0.30.1", "0.34.0", "0.34.0+cu130"])
def test_supported_vllm_versions_register_quietly(version):
    assert _vllm.version_status(version).ok


@pytest.mark.parametrize("version", ["0.35.0", "0.35.0rc1.dev12+g1234abc", "1.0.0"])
def test_newer_vllm_warns_and_registers(version):
    status = _vllm.version_status(version)
    assert status.register and f"tested up to vLLM 0.34 and found vLLM {version}" in status.message


def test_unreadable_version_registers_with_a_warning():
    status = _vllm.version_status("main")
    assert status.register and "cannot read vLLM's version 'main'" in status.message


def _run_with_vllm_version(version: str, body: str) -> subprocess.CompletedProcess:
    """A fresh process in which vLLM reports `version` to the plugin, then loads plugins as vLLM does."""
    code = (
        "import vllm_wna16_plugin._vllm as v\n"
        f"v.vllm_version = lambda: {version!r}\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n" + body
    )
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO", "VLLM_CONFIGURE_LOGGING": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def test_old_vllm_refuses_only_when_asked():
    # vLLM does not catch a plugin's exception: register() raising would end every vLLM process
    body = (
        "from vllm.model_executor.layers.quantization import get_quantization_config\n"
        "cls = get_quantization_config('moe_wna16_plus')\n"
        "assert cls.override_quantization_method({'quant_method': 'gptq'}, 'gptq') is None\n"
        "try:\n"
        "    cls.override_quantization_method({'quant_method': 'gptq'}, 'moe_wna16_plus')\n"
        "except ValueError as e:\n"
        "    print('REFUSED:', e)\n"
        "try:\n"
        "    cls.from_config({'quant_method': 'gptq', 'bits': 4, 'group_size': 128})\n"
        "except ValueError as e:\n"
        "    print('REFUSED:', e)\n"
    )
    out = _run_with_vllm_version("0.25.1", body)
    assert out.returncode == 0, out.stderr[-3000:]
    log = out.stdout + out.stderr
    assert out.stdout.count("REFUSED: vllm-wna16-plugin needs vLLM >= 0.26 and found vLLM 0.25.1") == 2, log[-3000:]
    # logged once, at registration (before vLLM 0.31+ configures its logger: then Python's last resort prints it)
    errors = [ln for ln in log.splitlines() if "needs vLLM >= 0.26" in ln and not ln.startswith("REFUSED")]
    assert len(errors) == 1, log[-3000:]


def test_newer_vllm_warns_once_and_works():
    body = (
        "import vllm_wna16_plugin\n"
        "vllm_wna16_plugin.register()\n"
        "from vllm.model_executor.layers.quantization import get_quantization_config\n"
        "print('NAME', get_quantization_config('moe_wna16_plus').__name__)\n"
    )
    out = _run_with_vllm_version("0.99.0", body)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "NAME MoeWNA16PlusConfig" in out.stdout
    warnings = [ln for ln in (out.stdout + out.stderr).splitlines() if "tested up to vLLM 0.34" in ln]
    assert len(warnings) == 1, out.stderr[-3000:]


def test_a_failing_registration_never_raises(monkeypatch):
    import vllm_wna16_plugin

    def broken(*_a, **_k):
        raise RuntimeError("simulated vLLM API change")

    monkeypatch.setattr(vllm_wna16_plugin, "_REGISTERED", False)
    monkeypatch.setattr(_vllm, "register_quantization_config", broken)
    vllm_wna16_plugin.register()  # logs, does not raise
    assert vllm_wna16_plugin._REGISTERED
