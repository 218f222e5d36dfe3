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
