"""Suite-wide set-up: the Triton interpreter switch, seeding, and a CPU vLLM context for layer tests."""

import os

# Set before anything imports triton: kernels are defined for the interpreter at import time.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def fresh_plans():
    """Each test plans as a new process would: tests write crossover and tuned tables into their own
    directories, and the process-wide plan cache (launch_plan._plan) would otherwise answer from another's."""
    from vllm_wna16_plugin import launch_plan

    launch_plan._plan.cache_clear()
    yield


@pytest.fixture(scope="session")
def vllm_cpu():
    """The VllmConfig of _vllm.cpu_layer_context (CPU, one gloo rank), for build_moe_layer."""
    import vllm_wna16_plugin
    from vllm_wna16_plugin import _vllm

    vllm_wna16_plugin.register()
    with _vllm.cpu_layer_context() as cfg:
        yield cfg


def simulate_ep_rank(monkeypatch: pytest.MonkeyPatch, vllm_cfg, rank: int) -> None:
    """Make the next layers built at tp_size=EP one rank of vLLM's own expert parallelism (`--enable-expert-
    parallel`: TP ranks become EP ranks, each holding a linear range of whole experts, E/EP of them or one more
    where EP does not divide E, and an expert_map; vLLM's round-robin placement needs grouped top-k routing):
    the parallel config asks for it, and vLLM's MoE parallel config reads this rank (one process holds every
    rank)."""
    import vllm.model_executor.layers.fused_moe.config as moe_config

    monkeypatch.setattr(vllm_cfg.parallel_config, "enable_expert_parallel", True)
    monkeypatch.setattr(moe_config, "get_tensor_model_parallel_rank", lambda: rank)


def build_moe_layer(
    vllm_cfg, raw: dict, *, E, H, I, top_k, tp_size=1, ckpt_names=("gate_proj", "down_proj", "up_proj")
):
    """A vLLM FusedMoE layer owned by moe_wna16_plus (its RoutedExperts), built on CPU under `vllm_cfg`."""
    from vllm.model_executor.layers.quantization import get_quantization_config

    from vllm_wna16_plugin import _vllm

    qc = get_quantization_config("moe_wna16_plus").from_config(raw)
    return _vllm.build_routed_experts(
        vllm_cfg, qc, num_experts=E, top_k=top_k, hidden=H, intermediate=I, prefix="model.layers.0.mlp.experts",
        ckpt_names=ckpt_names, tp_size=tp_size,
    )  # fmt: skip
