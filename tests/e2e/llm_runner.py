"""One offline LLM(...) run in its own process (vLLM holds the GPU per process); used by tests/e2e.

    python tests/e2e/llm_runner.py SPEC_JSON OUT_JSON

SPEC: {"model": path, "quantization": "moe_wna16_plus" | "moe_wna16" | ..., "prompts": [...],
       "max_tokens": 16, "eager": false, "moe_backend": "auto", "tp": 1, "logprobs": 5}
The plugin backend, if any, comes from VLLM_WNA16_PLUS_BACKEND in the environment.
OUT: {"ok": true, "tokens": [[...]], "text": [...], "first_logprobs": [{token: logprob}], "seconds": s}
or {"ok": false, "error": first line, "error_type": name}, so that a crash of vLLM's in-tree path
is a recorded result, not a failed run.
"""

from __future__ import annotations

import json
import sys
import time
import traceback


def main() -> int:
    spec = json.loads(open(sys.argv[1]).read())
    out_path = sys.argv[2]
    t0 = time.time()
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(
            model=spec["model"],
            tokenizer=spec["model"],
            quantization=spec.get("quantization"),
            moe_backend=spec.get("moe_backend", "auto"),
            tensor_parallel_size=spec.get("tp", 1),
            max_model_len=256,
            max_num_seqs=8,
            gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.25),
            attention_backend="TRITON_ATTN",  # the offline bundle has no flash-attn kernels
            enforce_eager=spec.get("eager", False),
            # no torch.compile (start-up time); decode steps replay full CUDA graphs unless eager
            compilation_config={
                "mode": 0,
                "cudagraph_mode": "FULL_DECODE_ONLY",
                "cudagraph_capture_sizes": [1, 2, 4, 8],
            },
        )
        params = SamplingParams(
            max_tokens=spec.get("max_tokens", 16), temperature=0.0, logprobs=spec.get("logprobs", 5)
        )
        results = llm.generate(spec["prompts"], params)
        first = []
        for r in results:
            lp = r.outputs[0].logprobs[0] if r.outputs[0].logprobs else {}
            first.append({str(tok): float(v.logprob) for tok, v in lp.items()})
        result = {
            "ok": True,
            "tokens": [list(r.outputs[0].token_ids) for r in results],
            "text": [r.outputs[0].text for r in results],
            "first_logprobs": first,
        }
    except Exception as exc:  # noqa: BLE001 - a crash is a result (vLLM's in-tree gs32 path)
        traceback.print_exc()
        msg = str(exc).strip().splitlines()
        result = {
            "ok": False,
            "error_type": type(exc).__name__,
            "error": msg[0][:500] if msg else "",
            "detail": str(exc)[-4000:],
        }  # fmt: skip - e.g. the stderr of vLLM's model-inspection subprocess
    result["seconds"] = time.time() - t0
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
