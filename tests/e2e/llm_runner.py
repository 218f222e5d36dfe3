"""One offline LLM(...) run in its own process (vLLM holds the GPU per process); used by tests/e2e.

    python tests/e2e/llm_runner.py SPEC_JSON OUT_JSON

SPEC: {"model": path, "quantization": "moe_wna16_plus" | "moe_wna16" | ..., "prompts": [...],
       "max_tokens": 16, "eager": false, "moe_backend": "auto", "tp": 1, "ep": false, "logprobs": 5, "dtype": "auto",
       "env": {name: value, set before vLLM is imported}, "reload_from": path (optional)}
With reload_from, the run generates once, reloads the weights of that checkpoint into the running engine
(vLLM's reload_weights on each worker: the layers' own tensors, which the captured CUDA graphs read) and
generates again; the result is the second generation's, the first one's tokens are "tokens_before_reload".
The plugin backend, if any, comes from VLLM_WNA16_PLUS_BACKEND in the environment.
OUT: {"ok": true, "tokens": [[...]], "text": [...], "first_logprobs": [{token: logprob}],
     "step_logprobs": [[{token: logprob} per step] per prompt], "seconds": s}
or {"ok": false, "error": first line, "error_type": name}, so that a crash of vLLM's in-tree path
is a recorded result, not a failed run.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

# no torch.compile (start-up time); decode steps replay full CUDA graphs unless eager
COMPILATION = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4, 8]}


def register_architectures_in_process(model: str) -> list[str]:
    """Import the checkpoint's architectures here, so vLLM inspects them in this process.

    vLLM inspects a lazily registered architecture in a subprocess (`python -m
    vllm.model_executor.models.registry`). On the offline GPU machine that subprocess exited with
    status 1 (2026-12-03, cause not yet seen: its stderr is printed by the retry's log). Registering
    the class itself skips the subprocess; the run records that it did (inspection_fallback)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.registry import _VLLM_MODELS

    archs = json.loads((Path(model) / "config.json").read_text()).get("architectures", [])
    for arch in archs:
        module, cls = _VLLM_MODELS[arch]
        ModelRegistry.register_model(
            arch, getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), cls)
        )
    return archs


def make_llm(spec: dict):
    from vllm import LLM

    return LLM(
        model=spec["model"],
        tokenizer=spec["model"],
        quantization=spec.get("quantization"),
        dtype=spec.get("dtype", "auto"),
        moe_backend=spec.get("moe_backend", "auto"),
        tensor_parallel_size=spec.get("tp", 1),
        enable_expert_parallel=spec.get("ep", False),  # vLLM's --enable-expert-parallel: whole experts per rank
        max_model_len=256,
        max_num_seqs=8,
        # a fixed, small KV cache skips vLLM's memory profiling, so that several runs share one GPU
        # (E2E_JOBS); the utilization only sets the free memory start-up asks for
        gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.04),
        kv_cache_memory_bytes=spec.get("kv_cache_memory_bytes", 256 << 20),
        attention_backend="TRITON_ATTN",  # the offline bundle has no flash-attn kernels
        enforce_eager=spec.get("eager", False),
        compilation_config=COMPILATION,
    )


def main() -> int:
    spec = json.loads(open(sys.argv[1]).read())
    os.environ.update(spec.get("env", {}))
    if spec.get("tp", 1) == 1:  # the engine in this process: one process fewer to start per run
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    out_path = sys.argv[2]
    t0 = time.time()
    phases = {}  # seconds per phase: where a run's time goes when many share the machine
    try:
        from vllm import SamplingParams

        phases["import"] = time.time() - t0

        fallback = False
        try:
            llm = make_llm(spec)
        except Exception as exc:  # noqa: BLE001
            if "failed to be inspected" not in str(exc):
                raise
            traceback.print_exc()
            print("llm_runner: model inspection failed in vLLM's subprocess; retrying in process", flush=True)
            register_architectures_in_process(spec["model"])
            fallback = True
            llm = make_llm(spec)
        phases["engine"] = time.time() - t0 - phases["import"]
        params = SamplingParams(
            max_tokens=spec.get("max_tokens", 16), temperature=0.0, logprobs=spec.get("logprobs", 5)
        )
        t_gen = time.time()
        results = llm.generate(spec["prompts"], params)
        phases["generate"] = time.time() - t_gen
        before = None
        if spec.get("reload_from"):
            before = [list(r.outputs[0].token_ids) for r in results]
            t_reload = time.time()
            llm.collective_rpc("reload_weights", kwargs={"weights_path": spec["reload_from"]})
            if hasattr(llm, "reset_prefix_cache"):  # no KV computed with the former weights may be reused
                llm.reset_prefix_cache()
            phases["reload"] = time.time() - t_reload
            results = llm.generate(spec["prompts"], params)
        # the top log-probs of every generated step (vLLM adds the chosen token's): conftest's agreement
        steps = [[{str(tok): float(v.logprob) for tok, v in lp.items()} for lp in (r.outputs[0].logprobs or [])]
                 for r in results]  # fmt: skip
        result = {
            "ok": True,
            "tokens": [list(r.outputs[0].token_ids) for r in results],
            "text": [r.outputs[0].text for r in results],
            "first_logprobs": [st[0] if st else {} for st in steps],
            "step_logprobs": steps,
            "inspection_fallback": fallback,
        }
        if before is not None:
            result["tokens_before_reload"] = before
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
    result["phases"] = {k: round(v, 1) for k, v in phases.items()}
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
