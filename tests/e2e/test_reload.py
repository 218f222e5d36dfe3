"""vLLM's reload_weights under CUDA graphs, end to end (GPU only).

An engine loads checkpoint A with decode CUDA graphs captured, generates, then reloads checkpoint B's weights
in place (`llm.collective_rpc("reload_weights", weights_path=B)`, as RL trainers push new weights) and
generates again. The graphs captured for A keep reading the tensors they were captured with, so the plugin
must copy B into those same tensors (LayerRunner.refresh_in_place): the sorted act-order weights, the `cuda`
backend's group-major scales, Marlin's and Humming's repacked copies. After the reload the engine must
generate like a fresh float32-reference load of B; before it, it must not (so the check can fail: a reload
that left the kernels on A's tensors would generate like A). The CPU twin drives vLLM's layerwise reload
directly: tests/test_moe_method.py::test_vllm_reload_weights_refreshes_the_kernels_tensors_in_place.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import HUMMING_COMPOSED, assert_generates_like, humming_missing, requires_gpu, run_llm

pytestmark = [pytest.mark.gpu, requires_gpu]

# name -> (make_checkpoint kwargs, backend); A and B differ only in their seed (the act-order case: in its
# g_idx too, so the sorted layout changes)
CASES = {
    "gptq-gs128-auto": (dict(fmt="gptq"), None),
    "gptq-gs128-cuda": (dict(fmt="gptq"), "cuda"),
    "gptq-gs128-marlin": (dict(fmt="gptq"), "marlin"),
    # attention stays float: vLLM 0.30+ refuses act order in linear layers (as in test_llm_generate.py)
    "gptq-desc-act-triton": (dict(fmt="gptq", desc_act=True, quantize_attention=False), "triton"),
    "gptq-desc-act-cuda": (dict(fmt="gptq", desc_act=True, quantize_attention=False), "cuda"),
    # large enough experts that auto composes with Humming where it is installed (tests/e2e/test_humming_compose.py)
    "gptq-e16-h2048-auto": (dict(fmt="gptq", hidden=2048, intermediate=1024, experts=16, top_k=4), None),
}
COMPOSES = "gptq-e16-h2048-auto"


def _pair(root, kwargs):
    from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

    a = make_checkpoint(root / "a", bits=4, group_size=128, layers=2, seed=11, **kwargs)
    b = make_checkpoint(root / "b", bits=4, group_size=128, layers=2, seed=12, **kwargs)
    return a, b


@pytest.mark.parametrize("name", list(CASES))
def test_reloaded_weights_generate_like_a_fresh_load_under_cuda_graphs(tmp_path_factory, name):
    kwargs, backend = CASES[name]
    a, b = _pair(tmp_path_factory.mktemp(name), kwargs)
    got = run_llm(a, tmp_path_factory.mktemp("reload"), backend=backend, reload_from=b)
    if not got.ok and got.result.get("error_type") == "AttributeError" and "reload_weights" in got.result["error"]:
        pytest.skip(f"this vLLM's workers have no reload_weights: {got.result['error']}")
    got.require_ok(f"{name}: load A, reload B")
    if name == COMPOSES and humming_missing() is None:  # Humming's repacked copy must be refreshed too
        assert HUMMING_COMPOSED in got.log, f"{name}: auto did not compose with Humming: {got.log[-3000:]}"
    ref_b = run_llm(b, tmp_path_factory.mktemp("ref"), backend="reference", eager=True).require_ok("reference B")
    assert got.result["tokens_before_reload"] != ref_b.result["tokens"], (
        f"{name}: A generated B's tokens before the reload: this case cannot tell a reload from none"
    )
    assert_generates_like(got, ref_b, f"{name}: after reloading B under CUDA graphs")
