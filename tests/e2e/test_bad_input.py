"""Bad checkpoints end to end (GPU only): the plugin's clear message reaches the user, from
LLM(...) and from `vllm serve`, before any kernel runs.

The malformed quantization_config case is the GPTQ block with bits=3. It fails at config time
with a message that names bits=3 and the supported widths. The missing-tensor case is one
expert's down_proj scales deleted from the safetensors. It fails at load with the plugin's
"is missing" message, which names the tensor. The sym-lie case is an asymmetric checkpoint whose
config says `sym: true`: it fails at load naming the qzeros tensor and the fix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from tests.e2e.conftest import SHARED_GPU_MEMORY, free_port, requires_gpu, run_llm

pytestmark = [pytest.mark.gpu, requires_gpu]

MISSING = "model.layers.1.mlp.experts.3.down_proj.scales"


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    from vllm_wna16_plugin.tools.make_checkpoint import MODEL_FILE, make_checkpoint

    root = tmp_path_factory.mktemp("bad")
    kw = dict(fmt="gptq", bits=4, group_size=32, hidden=512, intermediate=256, experts=8, top_k=2, layers=2)
    bad_config = make_checkpoint(root / "bits3", **kw)
    cfg = json.loads((bad_config / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 3
    (bad_config / "config.json").write_text(json.dumps(cfg, indent=2))
    missing = make_checkpoint(root / "missing", **kw)
    tensors = load_file(str(missing / MODEL_FILE))
    del tensors[MISSING]
    save_file(tensors, str(missing / MODEL_FILE), metadata={"format": "pt"})
    # real zero points under a config that says symmetric: a silently wrong layer if ignored
    sym_lie = make_checkpoint(root / "sym-lie", **{**kw, "sym": False, "quantize_attention": False})
    cfg = json.loads((sym_lie / "config.json").read_text())
    cfg["quantization_config"]["sym"] = True
    (sym_lie / "config.json").write_text(json.dumps(cfg, indent=2))
    return {
        "bits3": (bad_config, "bits=3"),
        "missing": (missing, MISSING),
        "sym-lie": (sym_lie, 'this checkpoint stores real zero points; set "sym": false'),
    }


def _no_kernel_trace(log: str) -> None:
    for marker in ("CUDA error", "illegal memory access", "triton.compiler.errors", "BLOCK_SIZE_K // group_size"):
        assert marker not in log, f"failed inside a kernel ({marker}) instead of at load"


@pytest.mark.parametrize("case", ["bits3", "missing", "sym-lie"])
def test_llm_shows_the_plugins_message(broken, tmp_path, case):
    path, needle = broken[case]
    run = run_llm(path, tmp_path, eager=True)
    assert not run.ok
    assert "moe_wna16_plus" in run.log and needle in run.log, run.log[-3000:]
    _no_kernel_trace(run.log)


@pytest.mark.parametrize("case", ["bits3", "missing", "sym-lie"])
def test_vllm_serve_shows_the_plugins_message_and_exits(broken, case):
    path, needle = broken[case]
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(path), "--quantization", "moe_wna16_plus",
           "--host", "127.0.0.1", "--port", str(free_port()), "--max-model-len", "256", *SHARED_GPU_MEMORY,
           "--attention-backend", "TRITON_ATTN", "--enforce-eager"]  # fmt: skip
    proc = subprocess.run(cmd, env=dict(os.environ, TRITON_INTERPRET="0"), capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert needle in log, log[-3000:]
    _no_kernel_trace(log)
