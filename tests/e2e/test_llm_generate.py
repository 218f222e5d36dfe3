"""LLM(..., quantization="moe_wna16_plus") end to end on a tiny checkpoint (GPU only).

Each backend runs in its own process (vLLM holds the GPU per process); greedy
tokens of every backend must equal those of the reference backend, up to a
first divergence late in the sequence (accumulation order).
The checkpoint is GPTQ int4 group 32 with MoE K=2048: the shape that crashes
vLLM's own moe_wna16 CUDA path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "Water is made of hydrogen and", "1 2 3 4 5"]

RUNNER = r"""
import json, os, sys, time
from vllm import LLM, SamplingParams
path, out = sys.argv[1], sys.argv[2]
t0 = time.time()
eager = os.environ.get("E2E_EAGER") == "1"
# No torch.compile (start-up time); decode runs in full CUDA graphs unless eager.
llm = LLM(model=path, tokenizer=path, quantization="moe_wna16_plus", max_model_len=256,
          gpu_memory_utilization=0.25, attention_backend="TRITON_ATTN", max_num_seqs=8, enforce_eager=eager,
          compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4, 8]})
prompts = json.loads(os.environ["E2E_PROMPTS"])
res = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))
json.dump({"tokens": [list(r.outputs[0].token_ids) for r in res], "text": [r.outputs[0].text for r in res],
           "seconds": time.time() - t0}, open(out, "w"))
"""


def _generate(path, backend: str, tmp_path, eager=False) -> dict:
    out = tmp_path / f"{backend}.json"
    env = dict(os.environ, VLLM_WNA16_PLUS_BACKEND=backend, E2E_PROMPTS=json.dumps(PROMPTS),
               E2E_EAGER="1" if eager else "0", TRITON_INTERPRET="0")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(path), str(out)], env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    if proc.returncode != 0:  # the first error lines tell more than the traceback's tail
        lines = proc.stderr.splitlines()
        first = [i for i, ln in enumerate(lines) if "Error" in ln or "error" in ln][:3]
        context = "\n".join("\n".join(lines[max(0, i - 15) : i + 5]) for i in first)
        raise AssertionError(f"{backend}: LLM run failed\n{context}\n...\n{proc.stderr[-3000:]}")
    log = proc.stderr + proc.stdout
    assert "moe_wna16_plus: using backend" in log, "the oracle did not explain its choice"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def gptq_gs32_k2048(tmp_path_factory):
    from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ck") / "gptq-gs32", fmt="gptq", bits=4, group_size=32,
                           hidden=2048, intermediate=256, experts=8, top_k=2, layers=2)  # fmt: skip


def _agree(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def reference_tokens(gptq_gs32_k2048, tmp_path_factory):
    return _generate(gptq_gs32_k2048, "reference", tmp_path_factory.mktemp("ref"), eager=True)


@pytest.mark.parametrize("backend", ["triton", "marlin", "vllm_cuda"])
def test_llm_generates_like_the_reference(gptq_gs32_k2048, reference_tokens, tmp_path, backend):
    ref = reference_tokens
    got = _generate(gptq_gs32_k2048, backend, tmp_path)
    print(f"{backend}: {got['seconds']:.0f}s, texts {got['text']}")
    for i, (r, g) in enumerate(zip(ref["tokens"], got["tokens"], strict=True)):
        assert _agree(r, g) >= 8, f"prompt {i}: {backend} diverges early: {g} vs reference {r}"
