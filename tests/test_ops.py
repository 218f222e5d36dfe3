"""The functional API, ops.fused_moe_wna16, on CPU: each backend that can run here through its adapter.

Under TRITON_INTERPRET=1 an explicit backend="triton" runs the Triton kernel in the interpreter.
That covers the triton backend's adapter (arguments, expert_map, router weight on input), not only
the kernel. backend="reference" covers the reference adapter. Backends that need a GPU refuse with
their reason before any launch.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import assert_close_scaled, make_moe_problem
from vllm_wna16_plugin.ops import fused_moe_wna16
from vllm_wna16_plugin.reference import fused_moe_wna16_ref


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("on_input", [False, True], ids=["weights-after", "weights-on-input"])
def test_backend_adapters_match_the_reference(backend, on_input):
    top_k = 1 if on_input else 2
    p = make_moe_problem(M=3, H=128, I=64, E=4, top_k=top_k, bits=4, gs1=32, zp=True, num_global_experts=6, seed=41)
    expert_map = torch.tensor([0, -1, 1, 2, -1, 3], dtype=torch.int32)
    kw = dict(p.kwargs(), expert_map=expert_map, apply_router_weight_on_input=on_input)
    out = fused_moe_wna16(*p.args(), **kw, group_size=32, backend=backend)
    ref = fused_moe_wna16_ref(*p.args(), **kw)
    assert_close_scaled(out, ref, torch.bfloat16, backend)


@pytest.mark.parametrize("backend", ["cuda", "marlin", "vllm_cuda"])
def test_gpu_backends_refuse_on_cpu_before_any_launch(backend):
    p = make_moe_problem(M=2, H=128, I=64, E=4, top_k=2, bits=4, gs1=32, seed=42)
    with pytest.raises(ValueError, match=rf"backend '{backend}' \(backend=\) cannot run .*needs an NVIDIA GPU"):
        fused_moe_wna16(*p.args(), **p.kwargs(), group_size=32, backend=backend)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_router_weight_on_the_input_needs_top_k_one_on_every_backend(backend):
    # triton and reference computed something for top_k=2 that vLLM does not define; cuda refused: now one answer
    p = make_moe_problem(M=2, H=128, I=64, E=4, top_k=2, bits=4, gs1=32, seed=43)
    with pytest.raises(ValueError, match=r"apply_router_weight_on_input=True with top_k=2: vLLM defines it for top_k"):
        fused_moe_wna16(*p.args(), **p.kwargs(), group_size=32, backend=backend, apply_router_weight_on_input=True)


@pytest.mark.parametrize("backend", ["auto", "triton", "reference"])
def test_more_routed_columns_than_experts_is_refused_by_name(backend):
    # top_k=3 over 2 experts: every row repeats an expert, which no router produces; it ran before
    p = make_moe_problem(M=2, H=128, I=64, E=2, top_k=2, bits=4, gs1=32, seed=44)
    ids = torch.tensor([[0, 1, 0], [1, 0, 1]], dtype=torch.int32)
    args = (*p.args()[:5], torch.full((2, 3), 1 / 3), ids)
    with pytest.raises(ValueError, match=r"top_k=3 columns but there are only 2 experts"):
        fused_moe_wna16(*args, **p.kwargs(), group_size=32, backend=backend)
