"""auto composed with Humming end to end (GPU only; sm90 with humming-kernels, i.e. vLLM 0.34's bundle).

The checkpoints' experts are large enough (16 experts of 2048 x 1024, top_k 4: about 3 MB each) that the
Humming rule (backends/humming.py) takes the prefill batches (64+ rows per hit expert; decode batches from about 5
sequences, > 35 MB of experts read) while the 1- and 3-sequence decode batches (about 12 and 28 MB) stay on the
plugin's kernels. With CUDA graphs, the composed layer must
generate like the float32 reference backend, log that it composed, and VLLM_WNA16_PLUS_HUMMING=0 must
keep it to one copy (the plugin's kernels alone), generating alike too. An AWQ (zero points) and an int8 checkpoint
of the same dimensions compose as well (the rule speaks for both since 2026-12-07).
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import (
    HUMMING_COMPOSED,
    HUMMING_NOT_COMPOSED,
    assert_generates_like,
    humming_missing,
    requires_gpu,
    run_llm,
)

pytestmark = [pytest.mark.gpu, requires_gpu]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    if why := humming_missing():
        pytest.skip(why)
    from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

    root = tmp_path_factory.mktemp("compose")
    return make_checkpoint(root / "gptq-e16-h2048", fmt="gptq", bits=4, group_size=128, hidden=2048,
                           intermediate=1024, experts=16, top_k=4, layers=2)  # fmt: skip


def test_auto_composed_with_humming_generates_like_the_reference(checkpoint, tmp_path_factory):
    ref = run_llm(checkpoint, tmp_path_factory.mktemp("ref"), backend="reference", eager=True)
    ref.require_ok("reference")
    composed = run_llm(checkpoint, tmp_path_factory.mktemp("auto")).require_ok("auto, composed")
    assert HUMMING_COMPOSED in composed.log, composed.log[-3000:]
    assert_generates_like(composed, ref, "auto composed with Humming")
    alone = run_llm(checkpoint, tmp_path_factory.mktemp("alone"), env={"VLLM_WNA16_PLUS_HUMMING": "0"})
    alone.require_ok("auto, VLLM_WNA16_PLUS_HUMMING=0")
    assert HUMMING_NOT_COMPOSED in alone.log and HUMMING_COMPOSED not in alone.log, alone.log[-3000:]
    assert_generates_like(alone, ref, "auto without Humming")


@pytest.mark.parametrize(
    "fmt, bits, sym",
    [("awq", 4, False), ("gptq", 8, True)],
    ids=["awq-zero-points", "gptq-int8"],
)
def test_auto_composes_int8_and_zero_point_checkpoints_with_humming(checkpoint, tmp_path_factory, fmt, bits, sym):
    """The Humming rule speaks for int8 and zero points too (backends/humming.HUMMING_RULE_FORMS): an AWQ and an int8
    checkpoint of the same dimensions compose under auto and generate like the reference."""
    from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

    ckpt = make_checkpoint(checkpoint.parent / f"{fmt}{bits}-e16-h2048", fmt=fmt, bits=bits, group_size=128, sym=sym,
                           hidden=2048, intermediate=1024, experts=16, top_k=4, layers=2)  # fmt: skip
    ref = run_llm(ckpt, tmp_path_factory.mktemp(f"ref-{fmt}{bits}"), backend="reference", eager=True)
    ref.require_ok(f"reference, {fmt} int{bits}")
    composed = run_llm(ckpt, tmp_path_factory.mktemp(f"auto-{fmt}{bits}")).require_ok(f"auto, {fmt} int{bits}")
    assert HUMMING_COMPOSED in composed.log, composed.log[-3000:]
    assert_generates_like(composed, ref, f"auto composed with Humming, {fmt} int{bits}")
