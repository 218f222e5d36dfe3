"""TP=2 generates what TP=1 generates (GPU only; runs where two GPUs are visible, else skips).

The checkpoint's expert intermediate size (512) splits into 256 per rank, a whole number of
gs128 groups. TP is exercised on the gate/up and down shards of every expert.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import assert_generates_like, gpus, run_llm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpus() < 2, reason="needs 2 GPUs (the nvidia-h200-x2 kind)")]


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_tp2_generates_like_tp1(tmp_path, backend):
    from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

    path = make_checkpoint(tmp_path / "ck", fmt="gptq", bits=4, group_size=128, hidden=1024, intermediate=512,
                           experts=8, top_k=2, layers=2)  # fmt: skip
    tp1 = run_llm(path, tmp_path, moe_backend=backend, tp=1).require_ok("TP=1")
    tp2 = run_llm(path, tmp_path, moe_backend=backend, tp=2).require_ok("TP=2")
    assert_generates_like(tp2, tp1, f"TP=2 vs TP=1 ({backend})")
