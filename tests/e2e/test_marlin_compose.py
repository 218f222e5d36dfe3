"""auto composed with Marlin end to end (GPU only; sm90 without humming-kernels, i.e. vLLM 0.26's bundle).

Where Humming is not installed, auto composes its layer with Marlin (compose.py, backends/marlin.py's rule).
The checkpoint's experts are large enough (8 experts of 2048 x 2048, top_k 2: about 6.5 MB each, 52 MB a
call that hits them all) that the Marlin rule takes a batch of 64 tokens or more (16 rows per hit expert,
over 40 MB read): the prefill with the long prompt, while the 4-sequence decode batches (CUDA graphs) stay on
the plugin's kernels. The composed layer must generate like the float32 reference backend and log that it
composed; VLLM_WNA16_PLUS_MARLIN=0 must keep it to one copy (the plugin's kernels alone), generating alike too.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import (
    MARLIN_COMPOSED,
    MARLIN_NOT_COMPOSED,
    PROMPTS,
    assert_generates_like,
    humming_missing,
    requires_gpu,
    run_llm,
    start_llm,
)

pytestmark = [pytest.mark.gpu, requires_gpu]

# a prefill batch of well over 64 tokens: the Marlin rule's side of the layer
LONG_PROMPT = " ".join(["The river runs to the sea and the sea runs to the sky ."] * 5)  # about 135 tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Marlin rule speaks for sm90 only")
    if humming_missing() is None:
        pytest.skip("humming-kernels is installed: auto composes with Humming (tests/e2e/test_humming_compose.py)")
    from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

    root = tmp_path_factory.mktemp("compose-marlin")
    return make_checkpoint(root / "gptq-e8-h2048", fmt="gptq", bits=4, group_size=128, hidden=2048,
                           intermediate=2048, experts=8, top_k=2, layers=2)  # fmt: skip


def test_auto_composed_with_marlin_generates_like_the_reference(checkpoint, tmp_path_factory):
    prompts = [*PROMPTS, LONG_PROMPT]
    alone_env = {"VLLM_WNA16_PLUS_MARLIN": "0"}
    for tag, kwargs in (("ref", dict(backend="reference", eager=True)), ("auto", {}), ("alone", dict(env=alone_env))):
        start_llm(checkpoint, tmp_path_factory.mktemp(tag), prompts=prompts, **kwargs)  # side by side (E2E_JOBS)
    ref = run_llm(checkpoint, tmp_path_factory.mktemp("ref"), backend="reference", eager=True, prompts=prompts)
    ref.require_ok("reference")
    composed = run_llm(checkpoint, tmp_path_factory.mktemp("auto"), prompts=prompts).require_ok("auto, composed")
    assert MARLIN_COMPOSED in composed.log, composed.log[-3000:]
    assert_generates_like(composed, ref, "auto composed with Marlin")
    alone = run_llm(checkpoint, tmp_path_factory.mktemp("alone"), prompts=prompts, env=alone_env)
    alone.require_ok("auto, VLLM_WNA16_PLUS_MARLIN=0")
    assert MARLIN_NOT_COMPOSED in alone.log and MARLIN_COMPOSED not in alone.log, alone.log[-3000:]
    assert_generates_like(alone, ref, "auto without Marlin")


@pytest.mark.parametrize(
    "fmt, bits, sym",
    [("awq", 4, False), ("gptq", 8, True)],
    ids=["awq-zero-points", "gptq-int8"],
)
def test_auto_composes_int8_and_zero_point_checkpoints_with_marlin(checkpoint, tmp_path_factory, fmt, bits, sym):
    """The Marlin rule speaks for int8 and zero points too (backends/marlin.MARLIN_RULE_FORMS): an AWQ and an int8
    checkpoint of the same dimensions compose under auto (the hopper copy off, so that Marlin's rule sees the long
    prompt's batch) and generate like the reference."""
    from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

    ckpt = make_checkpoint(checkpoint.parent / f"{fmt}{bits}-e8-h2048", fmt=fmt, bits=bits, group_size=128, sym=sym,
                           hidden=2048, intermediate=2048, experts=8, top_k=2, layers=2)  # fmt: skip
    prompts, env = [*PROMPTS, LONG_PROMPT], {"VLLM_WNA16_PLUS_HOPPER": "0"}
    ref = run_llm(ckpt, tmp_path_factory.mktemp(f"ref-{fmt}{bits}"), backend="reference", eager=True, prompts=prompts)
    ref.require_ok(f"reference, {fmt} int{bits}")
    composed = run_llm(ckpt, tmp_path_factory.mktemp(f"auto-{fmt}{bits}"), prompts=prompts, env=env)
    composed.require_ok(f"auto, {fmt} int{bits}")
    assert MARLIN_COMPOSED in composed.log, composed.log[-3000:]
    assert_generates_like(composed, ref, f"auto composed with Marlin, {fmt} int{bits}")
