"""vllm-wna16 demo without a GPU: the README's command, run as a newcomer runs it.

Each run is a subprocess with no visible GPU (vLLM's distributed state is per process).
On CPU the demo builds the checkpoint's MoE layers through vLLM's FusedMoE weight
loader and checks each one against float math on the dequantized experts. The tests
check that a correct checkpoint passes, that a corrupted one fails, and that a backend
that cannot run gives a message and not a traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from vllm_wna16_plugin.tools.demo import CPU_TOLERANCE, device_key
from vllm_wna16_plugin.tools.make_checkpoint import MODEL_FILE, make_checkpoint

pytestmark = pytest.mark.slow


def run_demo(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="0")
    return subprocess.run(
        [sys.executable, "-m", "vllm_wna16_plugin.tools.cli", "demo", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_demo_default_checkpoint_runs_every_moe_layer_on_cpu(tmp_path):
    proc = run_demo("--out", str(tmp_path / "ck"))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    # the default checkpoint is GPTQ int4 gs32 with K=2048 (vLLM's crash shape), planned for this machine
    assert "scheme: gptq int4 group 32 symmetric" in out and "gate/up  K=  2048" in out
    assert "backend on cpu (auto): reference" in out and "no CUDA GPU found" in out
    for layer in (0, 1):
        assert f"model.layers.{layer}.mlp.experts: moe_wna16_plus: using backend 'reference'" in out
    results = [line for line in out.splitlines() if "max error" in line]
    assert len(results) == 2 and all(line.endswith(": ok") for line in results), results


def test_demo_catches_a_corrupted_checkpoint(tmp_path):
    # Swap two experts' gate weights on disk. The layer still loads, but its output no longer matches
    # the float math on the experts the checkpoint was made from.
    path = make_checkpoint(tmp_path / "ck", fmt="gptq", bits=4, group_size=32, hidden=256, intermediate=128,
                           experts=4, top_k=2, layers=1, seed=3)  # fmt: skip
    tensors = load_file(str(path / MODEL_FILE))
    a, b = (f"model.layers.0.mlp.experts.{e}.gate_proj.qweight" for e in (0, 1))
    tensors[a], tensors[b] = tensors[b], tensors[a]
    save_file(tensors, str(path / MODEL_FILE), metadata={"format": "pt"})
    proc = run_demo("--checkpoint", str(path), "--cpu")
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert f"FAILED (tolerance {CPU_TOLERANCE:.3g})" in proc.stdout


def test_demo_explicit_backend_that_cannot_run_is_a_message(tmp_path):
    proc = run_demo("--out", str(tmp_path / "ck"), "--hidden", "256", "--layers", "1", "--backend", "marlin")
    assert proc.returncode == 2, proc.stdout + proc.stderr[-3000:]
    assert "error: moe_wna16_plus: backend 'marlin' (VLLM_WNA16_PLUS_BACKEND) cannot run" in proc.stdout
    assert "Backends that would work: ['reference']" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_demo_rejects_a_bad_shape_before_running(tmp_path):
    proc = run_demo("--out", str(tmp_path / "ck"), "--hidden", "250")
    assert proc.returncode == 2 and proc.stdout.startswith("error:"), proc.stdout + proc.stderr[-2000:]


def test_device_key_on_cpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert device_key() == "cpu"
