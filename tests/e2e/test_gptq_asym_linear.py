"""Asymmetric GPTQ linear layers end to end (GPU only): attention stored as asymmetric GPTQ runs on
gptq_linear.py's kernels and must generate like the same model whose attention holds the float weights
those GPTQ tensors dequantize to (conftest.dequantize_attention). The experts run on the reference backend
in both runs, so only the attention projections differ: Marlin with zero points (bfloat16) or vLLM's
exllama kernel (int8, float16) against vLLM's unquantized linear layers.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import assert_generates_like, dequantize_attention, gpus, requires_gpu, run_llm

pytestmark = [pytest.mark.gpu, requires_gpu]

# name -> (make_checkpoint kwargs, vLLM dtype, the kernel the plugin logs). Attention is quantized (the default).
CASES = {
    "int4-gs128-v1": (dict(bits=4, group_size=128), None, "Marlin"),
    "int4-gs32-v2": (dict(bits=4, group_size=32, checkpoint_format="gptq_v2"), None, "Marlin"),
    "int4-channelwise-v1-fp16": (dict(bits=4, group_size=-1), "float16", "Marlin"),
    "int8-gs128-v1-fp16": (dict(bits=8, group_size=128), "float16", "exllama"),  # Marlin has no int8 with zero points
}


def _checkpoint(root, kwargs):
    from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

    return make_checkpoint(root / "ck", fmt="gptq", sym=False, hidden=1024, intermediate=256, experts=8, top_k=2,
                           layers=2, **kwargs)  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_asymmetric_gptq_attention_generates_like_its_float_twin(tmp_path_factory, name):
    kwargs, dtype, kernel = CASES[name]
    root = tmp_path_factory.mktemp(f"asym-{name}")
    ckpt = _checkpoint(root, kwargs)
    twin = dequantize_attention(ckpt, root / "float-attention")
    ref = run_llm(twin, tmp_path_factory.mktemp("runs-float"), backend="reference", eager=True, dtype=dtype)
    ref.require_ok(f"{name}: float attention")
    # eager with the reference experts (only attention differs), then as served: CUDA graphs, auto experts
    for what, how in (("eager", dict(backend="reference", eager=True)), ("CUDA graphs", dict(eager=False))):
        run = run_llm(ckpt, tmp_path_factory.mktemp("runs-gptq"), dtype=dtype, **how)
        run.require_ok(f"{name}: asymmetric GPTQ attention ({what})")
        assert f"asymmetric GPTQ linear layers run on vLLM's {kernel} kernel" in run.log, run.log[-3000:]
        assert_generates_like(run, ref, f"{name} ({what})")


@pytest.mark.skipif(gpus() < 2, reason="needs 2 GPUs (the nvidia-h200-x2 kind)")
def test_tp2_asymmetric_gptq_linears_generate_like_tp1(tmp_path):
    """qkv and gate/up split along N, o_proj along K (gs128: 512 per rank, 4 groups)."""
    ckpt = _checkpoint(tmp_path, dict(bits=4, group_size=128))
    tp1 = run_llm(ckpt, tmp_path, tp=1).require_ok("TP=1")
    tp2 = run_llm(ckpt, tmp_path, tp=2).require_ok("TP=2")
    assert_generates_like(tp2, tp1, "asymmetric GPTQ TP=2 vs TP=1")
