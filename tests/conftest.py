"""Suite-wide set-up: the Triton interpreter switch, seeding, and a CPU vLLM context for layer tests."""

import os

# Set before anything imports triton: kernels are defined for the interpreter at import time.
os.environ.setdefault("TRITON_INTERPRET", "1")

import tempfile  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def vllm_cpu():
    """A vLLM config + single-process (gloo) distributed group on CPU, so FusedMoE layers can be built.

    Yields a function that builds a FusedMoE runner under that config.
    """
    import vllm_wna16_plugin

    vllm_wna16_plugin.register()
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(cfg):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{tempfile.mktemp(prefix='wna16-dist-')}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        yield cfg


def build_moe_layer(
    vllm_cfg, raw: dict, *, E, H, I, top_k, tp_size=1, ckpt_names=("gate_proj", "down_proj", "up_proj")
):
    """A vLLM FusedMoE layer owned by moe_wna16_plus (its RoutedExperts), built on CPU under `vllm_cfg`."""
    from vllm.model_executor.layers.fused_moe import FusedMoE
    from vllm.model_executor.layers.quantization import get_quantization_config

    qc = get_quantization_config("moe_wna16_plus").from_config(raw)
    prefix = "model.layers.0.mlp.experts"
    vllm_cfg.compilation_config.static_forward_context.pop(prefix, None)  # layers are rebuilt per test
    runner = FusedMoE(
        num_experts=E,
        top_k=top_k,
        hidden_size=H,
        intermediate_size=I,
        params_dtype=torch.bfloat16,
        quant_config=qc,
        tp_size=tp_size,
        prefix=prefix,
        ckpt_names=ckpt_names,
    )
    return runner.routed_experts
