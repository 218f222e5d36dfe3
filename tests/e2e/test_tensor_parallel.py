"""TP=2 and EP=2 generate what TP=1 generates (GPU only; runs where two GPUs are visible, else skips).

The checkpoint's expert intermediate size (512) splits into 256 per rank, a whole number of
gs128 groups. TP is exercised on the gate/up and down shards of every expert; act order on the down
projection's uneven share of each group (a rank's rows padded: backends/base.act_order_padded); zero
points (AWQ) on the zeros' shards; EP (vLLM's --enable-expert-parallel) on a rank holding 4 of the 8
experts whole, the others' routed pairs masked by vLLM's expert map.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import assert_generates_like, gpus, run_llm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpus() < 2, reason="needs 2 GPUs (the nvidia-h200-x2 kind)")]


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_tp2_generates_like_tp1(tmp_path, backend):
    path = _checkpoint(tmp_path, fmt="gptq")
    tp1 = run_llm(path, tmp_path, moe_backend=backend, tp=1).require_ok("TP=1")
    tp2 = run_llm(path, tmp_path, moe_backend=backend, tp=2).require_ok("TP=2")
    assert_generates_like(tp2, tp1, f"TP=2 vs TP=1 ({backend})")


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_ep2_generates_like_tp1(tmp_path, backend):
    path = _checkpoint(tmp_path, fmt="gptq")
    tp1 = run_llm(path, tmp_path, moe_backend=backend, tp=1).require_ok("TP=1")
    ep2 = run_llm(path, tmp_path, moe_backend=backend, tp=2, ep=True).require_ok("EP=2")
    assert_generates_like(ep2, tp1, f"EP=2 vs TP=1 ({backend})")


@pytest.mark.parametrize(
    "fmt, desc_act, backend",
    [("gptq", True, "auto"), ("gptq", True, "triton"), ("awq", False, "auto")],  # AWQ: zero points
    ids=["gptq-desc-act-auto", "gptq-desc-act-triton", "awq-auto"],
)
def test_tp2_forms_generate_like_tp1(tmp_path, fmt, desc_act, backend):
    # vLLM 0.30+ refuses act order on linear layers: attention stays bf16 in the act-order checkpoint
    path = _checkpoint(tmp_path, fmt=fmt, desc_act=desc_act, sym=fmt != "awq", quantize_attention=not desc_act)
    tp1 = run_llm(path, tmp_path, moe_backend=backend, tp=1).require_ok("TP=1")
    tp2 = run_llm(path, tmp_path, moe_backend=backend, tp=2).require_ok("TP=2")
    assert_generates_like(tp2, tp1, f"TP=2 vs TP=1 ({fmt}{' desc_act' if desc_act else ''}, {backend})")


def _checkpoint(tmp_path, **kw):
    from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

    return make_checkpoint(tmp_path / "ck", bits=4, group_size=128, hidden=1024, intermediate=512, experts=8,
                           top_k=2, layers=2, **kw)  # fmt: skip
