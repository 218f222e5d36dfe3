"""auto with the hopper kernel's copy end to end (GPU only; sm90 with the plugin's hopper extension built).

The checkpoint's experts (8 of 2048 x 2048, top_k 2) take 64 rows per hit expert from 256 tokens: the prefill of
the long prompts is the hopper rule's (backends/hopper.py), the 5-sequence decode batches (CUDA graphs) stay on the
plugin's other kernels. The vLLM partners are turned off (VLLM_WNA16_PLUS_HUMMING=0, VLLM_WNA16_PLUS_MARLIN=0) so
that the hopper kernel takes those batches on any vLLM. The layer must log the hopper copy and generate like the
float32 reference backend; VLLM_WNA16_PLUS_HOPPER=0 must leave the copy out and generate alike, and
VLLM_WNA16_PLUS_BACKEND=hopper (every batch on the hopper kernel, decode graphs included) too. A float16 run takes the
fp16 build under auto; an AWQ checkpoint (zero points, run as int8 q - z) runs the int8 builds under auto and named,
a symmetric int8 one where named (auto's rule is not yet timed on it: backends/hopper.HOPPER_RULE_FORMS).
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import (
    HOPPER_COMPOSED,
    HOPPER_NOT_COMPOSED,
    HOPPER_RAN,
    PROMPTS,
    assert_generates_like,
    requires_gpu,
    run_llm,
    start_llm,
)

pytestmark = [pytest.mark.gpu, requires_gpu]

# two prompts of about 200 tokens each (the runs' context is 256 tokens, 16 of them generated; the checkpoint's
# tokenizer is byte-level, about two characters a token): the first step's batch of about 430 tokens gives each
# of 8 experts about 107 rows, the hopper rule's side of the layer
SENTENCES = (
    "The river runs to the sea and the sea runs to the sky .",
    "Seven small boats sail past the old stone lighthouse at dawn .",
)


def long_prompts(checkpoint, tokens: int = 200) -> list[str]:
    """Each sentence repeated, word by word, to at most `tokens` tokens of the checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    prompts = []
    for sentence in SENTENCES:
        words, text = sentence.split(), ""
        for i in range(10 * tokens):
            longer = f"{text} {words[i % len(words)]}".strip()
            if len(tok(longer).input_ids) > tokens:
                break
            text = longer
        prompts.append(text)
    return prompts


NO_PARTNER = {"VLLM_WNA16_PLUS_HUMMING": "0", "VLLM_WNA16_PLUS_MARLIN": "0"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the hopper kernel is built for sm90a only")
    from vllm_wna16_plugin.kernels.hopper_ops import extension_error

    if reason := extension_error():
        pytest.skip(reason)
    from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

    root = tmp_path_factory.mktemp("compose-hopper")
    return make_checkpoint(root / "gptq-e8-h2048", fmt="gptq", bits=4, group_size=128, hidden=2048,
                           intermediate=2048, experts=8, top_k=2, layers=2)  # fmt: skip


def test_auto_with_the_hopper_copy_generates_like_the_reference(checkpoint, tmp_path_factory):
    prompts = [*PROMPTS, *long_prompts(checkpoint)]
    runs = {
        "ref": dict(backend="reference", eager=True),
        "auto": dict(env=NO_PARTNER),
        "alone": dict(env={**NO_PARTNER, "VLLM_WNA16_PLUS_HOPPER": "0"}),
        "hopper": dict(backend="hopper", env=NO_PARTNER),
    }
    dirs = {tag: tmp_path_factory.mktemp(tag) for tag in runs}
    for tag, kwargs in runs.items():
        start_llm(checkpoint, dirs[tag], prompts=prompts, **kwargs)  # side by side (E2E_JOBS)
    ref = run_llm(checkpoint, dirs["ref"], prompts=prompts, **runs["ref"]).require_ok("reference")
    composed = run_llm(checkpoint, dirs["auto"], prompts=prompts, **runs["auto"]).require_ok("auto with hopper")
    assert HOPPER_COMPOSED in composed.log and HOPPER_RAN in composed.log, composed.log[-3000:]
    assert_generates_like(composed, ref, "auto with the hopper copy")
    alone = run_llm(checkpoint, dirs["alone"], prompts=prompts, **runs["alone"]).require_ok("VLLM_WNA16_PLUS_HOPPER=0")
    assert HOPPER_NOT_COMPOSED in alone.log and HOPPER_RAN not in alone.log, alone.log[-3000:]
    assert_generates_like(alone, ref, "auto without the hopper copy")
    named = run_llm(checkpoint, dirs["hopper"], prompts=prompts, **runs["hopper"]).require_ok("backend hopper")
    assert HOPPER_RAN in named.log, named.log[-3000:]
    assert_generates_like(named, ref, "VLLM_WNA16_PLUS_BACKEND=hopper")


@pytest.fixture(scope="module")
def awq_checkpoint(checkpoint):
    """An AWQ checkpoint (zero points) of the same dimensions: run by the hopper kernel as int8 q - z."""
    from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

    return make_checkpoint(checkpoint.parent / "awq-e8-h2048", fmt="awq", bits=4, group_size=128, sym=False,
                           hidden=2048, intermediate=2048, experts=8, top_k=2, layers=2)  # fmt: skip


def _auto_with_the_copy_generates_like_the_reference(checkpoint, tmp_path_factory, what: str, **run) -> None:
    """auto (partners off) and the reference backend, both with `run`'s LLM arguments: auto must log the hopper copy
    and its first batch, and generate like the reference."""
    prompts = [*PROMPTS, *long_prompts(checkpoint)]
    runs = {"ref": dict(backend="reference", eager=True, **run), "auto": dict(env=NO_PARTNER, **run)}
    dirs = {tag: tmp_path_factory.mktemp(f"{tag}-{what.replace(' ', '-')}") for tag in runs}
    for tag, kwargs in runs.items():
        start_llm(checkpoint, dirs[tag], prompts=prompts, **kwargs)
    ref = run_llm(checkpoint, dirs["ref"], prompts=prompts, **runs["ref"]).require_ok(f"reference, {what}")
    composed = run_llm(checkpoint, dirs["auto"], prompts=prompts, **runs["auto"]).require_ok(f"auto, {what}")
    assert HOPPER_COMPOSED in composed.log and HOPPER_RAN in composed.log, composed.log[-3000:]
    assert_generates_like(composed, ref, f"auto with the hopper copy, {what}")


def _named_backend_generates_like_the_reference(checkpoint, tmp_path_factory, what: str, backend: str = "hopper"):
    """VLLM_WNA16_PLUS_BACKEND=`backend` (every batch, decode graphs included) and the reference backend: the run must
    generate like the reference (and, named hopper, log the hopper kernel's first batch)."""
    prompts = [*PROMPTS, *long_prompts(checkpoint)]
    runs = {"ref": dict(backend="reference", eager=True), backend: dict(backend=backend, env=NO_PARTNER)}
    dirs = {tag: tmp_path_factory.mktemp(f"{tag}-{what}") for tag in runs}
    for tag, kwargs in runs.items():
        start_llm(checkpoint, dirs[tag], prompts=prompts, **kwargs)
    ref = run_llm(checkpoint, dirs["ref"], prompts=prompts, **runs["ref"]).require_ok(f"reference, {what}")
    named = run_llm(checkpoint, dirs[backend], prompts=prompts, **runs[backend]).require_ok(f"{backend}, {what}")
    if backend == "hopper":
        assert HOPPER_RAN in named.log, named.log[-3000:]
    assert_generates_like(named, ref, f"VLLM_WNA16_PLUS_BACKEND={backend} on {what}")


def test_the_hopper_backend_on_an_awq_checkpoint_generates_like_the_reference(awq_checkpoint, tmp_path_factory):
    """Zero points (AWQ): the hopper copy holds int8 q - z (hopper_ops.zero_point_weights); named it runs every
    batch."""
    _named_backend_generates_like_the_reference(awq_checkpoint, tmp_path_factory, "awq")


def test_auto_with_the_hopper_copy_on_an_awq_checkpoint_generates_like_the_reference(awq_checkpoint, tmp_path_factory):
    """auto's rule takes int4 with zero points (backends/hopper.HOPPER_RULE_FORMS): the AWQ layer holds the int8 q - z
    copy and hands it the prefill."""
    _auto_with_the_copy_generates_like_the_reference(awq_checkpoint, tmp_path_factory, "awq")


def test_auto_with_the_hopper_copy_in_float16_generates_like_the_reference(checkpoint, tmp_path_factory):
    """The same checkpoint run with --dtype float16: the hopper kernel's fp16 build takes the prefill."""
    _auto_with_the_copy_generates_like_the_reference(checkpoint, tmp_path_factory, "float16", dtype="float16")


@pytest.fixture(scope="module")
def int8_checkpoint(checkpoint):
    """A symmetric int8 GPTQ checkpoint of the same dimensions: the hopper kernel's int8 build."""
    from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

    return make_checkpoint(checkpoint.parent / "gptq8-e8-h2048", fmt="gptq", bits=8, group_size=128,
                           hidden=2048, intermediate=2048, experts=8, top_k=2, layers=2)  # fmt: skip


# The hopper run of this checkpoint leaves the float32 reference at prompt 1, step 12, on the H200 and the H100 alike,
# where the Triton and Marlin runs of the same checkpoint do not (2026-12-07). The layer's error is the one every
# kernel that rounds the dequantized weight q * s to bf16 has: on this shape with a checkpoint's scales, rounding the
# weights alone moves the layer's output by 0.0053 (relative, CPU, reference.dequantize_ref rounded), and the hopper
# layer's measured error is 0.0052-0.0058 (bench/hopper_layer_diag.py, case int8-e2e); int4 with a checkpoint's
# scales has the same 0.0050. A greedy run of a random-weight model then flips wherever two tokens are close, and which
# kernel flips where is chance: not a fault of this kernel (docs/perf/hopper-path.md, seventeenth session).
INT8_HOPPER_FLIP = "prompt 1 diverges at step 12"


@pytest.mark.parametrize("backend", ["hopper", "triton", "marlin"])
def test_a_named_backend_on_an_int8_checkpoint_generates_like_the_reference(int8_checkpoint, tmp_path_factory, backend):
    """int8 is in the kernel's scope but not yet in auto's rule (backends/hopper.hopper_rule_gap): named
    (VLLM_WNA16_PLUS_BACKEND=hopper), every batch, decode graphs included, runs the int8 build. The controls on the
    same checkpoint, Triton and Marlin, generate like the reference (H100, 2026-12-07); the hopper run flips a token
    at step 12 (INT8_HOPPER_FLIP above): that flip, and only it, is an expected failure."""
    try:
        _named_backend_generates_like_the_reference(int8_checkpoint, tmp_path_factory, f"int8-{backend}", backend)
    except AssertionError as exc:  # that one flip, and nothing else (a failed load or another divergence fails)
        if backend == "hopper" and INT8_HOPPER_FLIP in str(exc):
            pytest.xfail(f"greedy flip ({INT8_HOPPER_FLIP}) on this random checkpoint: bf16 weight rounding, every "
                         "kernel's (docs/perf/hopper-path.md)")  # fmt: skip
        raise
