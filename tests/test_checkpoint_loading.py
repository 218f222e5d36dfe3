"""Tiny on-disk checkpoints of every format, loaded through vLLM's FusedMoE weight loader on CPU.

The layer's forward (reference backend on CPU) must equal the float math on the
checkpoint's own dequantized experts (reference/ beside it), and stay close to
the original float weights.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from tests.conftest import build_moe_layer
from vllm_wna16_plugin.reference import fused_moe_ref
from vllm_wna16_plugin.tools.make_checkpoint import load_reference, make_checkpoint

H, I, E, TOP_K = 128, 64, 4, 2

CASES = [
    pytest.param(dict(fmt="gptq", bits=4, group_size=32), id="gptq-int4-gs32"),
    pytest.param(dict(fmt="gptq", bits=4, group_size=64, sym=False, checkpoint_format="gptq_v2"), id="gptq-asym-v2"),
    pytest.param(dict(fmt="gptq", bits=8, group_size=32), id="gptq-int8"),
    pytest.param(dict(fmt="gptq", bits=4, group_size=32, desc_act=True), id="gptq-desc-act"),  # reference only
    pytest.param(dict(fmt="awq", bits=4, group_size=32, sym=False), id="awq-gs32"),
    pytest.param(dict(fmt="compressed-tensors", bits=4, group_size=-1, group_size_null=True), id="ct-channel-null"),
    pytest.param(dict(fmt="compressed-tensors", bits=4, group_size=32, sym=False), id="ct-gs32-asym"),
    pytest.param(dict(fmt="gptq", bits=4, group_size=32, arch="mixtral"), id="mixtral-gptq"),
]


def _experts_of_layer0(path, arch):
    prefix = "model.layers.0.block_sparse_moe.experts." if arch == "mixtral" else "model.layers.0.mlp.experts."
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return [(k.removeprefix(prefix), f.get_tensor(k)) for k in f.keys() if k.startswith(prefix)]


@pytest.mark.parametrize("kwargs", CASES)
def test_tiny_checkpoint_loads_and_matches(vllm_cpu, tmp_path, kwargs):
    arch = kwargs.get("arch", "qwen3_moe")
    path = make_checkpoint(tmp_path / "ck", hidden=H, intermediate=I, experts=E, top_k=TOP_K, layers=1, **kwargs)
    raw = json.loads((path / "config.json").read_text())["quantization_config"]
    names = ("w1", "w2", "w3") if arch == "mixtral" else ("gate_proj", "down_proj", "up_proj")
    layer = build_moe_layer(vllm_cpu, raw, E=E, H=H, I=I, top_k=TOP_K, ckpt_names=names)
    loaded = set(layer.load_weights(_experts_of_layer0(path, arch)))
    assert any("qweight" in n or "weight_packed" in n for n in loaded)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.quant_method.selection.backend.name == "reference"  # CPU

    ref = load_reference(path)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(5)])
    w = torch.rand(5, TOP_K, generator=g)
    out = layer.quant_method.apply(layer, x, w, ids, None, None).float()
    exact = fused_moe_ref(x, ref["layers.0.w13"], ref["layers.0.w2"], w, ids).float()
    err = (out - exact).abs().max().item()
    assert err <= exact.abs().max().item() * 2**-6, f"max error {err:.3g} vs dequantized truth"
    floats = fused_moe_ref(x, ref["layers.0.w13_float"], ref["layers.0.w2_float"], w, ids).float()
    rel = ((out - floats).norm() / floats.norm()).item()
    assert rel < (0.05 if kwargs["bits"] == 8 else 0.25), f"far from the float weights: rel {rel:.3g}"
