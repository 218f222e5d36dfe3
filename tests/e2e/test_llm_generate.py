"""LLM(..., quantization="moe_wna16_plus") end to end on tiny checkpoints of every format (GPU only).

For each checkpoint, the reference backend (float32 torch, eager) gives the baseline tokens.
Each backend the plugin accepts then runs the same prompts greedily, with CUDA graphs, and must
generate like the baseline (conftest.assert_generates_like). vLLM's --moe-backend names are
passed as --moe-backend; vllm_cuda and cuda, which have no vLLM name, go through
VLLM_WNA16_PLUS_BACKEND. A backend whose oracle rejects the checkpoint must fail at load with
the plugin's message. vLLM's own paths (its in-tree moe_wna16, and its default method for the
format) run the same checkpoint. Where they run, they must agree; where they crash, the crash
is recorded in E2E_RECORD (a JSON-lines file, default e2e-record.jsonl in the tmp dir).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.e2e.conftest import (
    assert_generates_like,
    e2e_jobs,
    generation_disagreement,
    requires_gpu,
    rotate_experts,
    run_llm,
    start_llm,
)

pytestmark = [pytest.mark.gpu, requires_gpu]

# name -> make_checkpoint kwargs. Every one has 2 layers, 8 experts, top_k 2.
CHECKPOINTS = {
    # gate/up K=2048 at gs32: vLLM's moe_wna16 CUDA path picks BLOCK_SIZE_K=512 (ratio 16) and crashes
    "gptq-gs32-k2048": dict(fmt="gptq", bits=4, group_size=32, hidden=2048, intermediate=256),
    "gptq-gs128": dict(fmt="gptq", bits=4, group_size=128, hidden=1024, intermediate=256),
    # attention quantized too: vLLM's GPTQ linear method refuses sym=false, the plugin's (gptq_linear.py) runs it
    "gptq-asym": dict(fmt="gptq", bits=4, group_size=128, sym=False, hidden=1024, intermediate=256),
    "gptq-int8": dict(fmt="gptq", bits=8, group_size=128, hidden=1024, intermediate=256),
    "awq-gs128": dict(fmt="awq", bits=4, group_size=128, sym=False, hidden=1024, intermediate=256),
    "ct-channel-null": dict(
        fmt="compressed-tensors", bits=4, group_size=-1, group_size_null=True, hidden=1024, intermediate=256
    ),  # fmt: skip
    "ct-gs128-asym": dict(fmt="compressed-tensors", bits=4, group_size=128, sym=False, hidden=1024, intermediate=256),
    # K=1344 at gs32: vLLM picks BLOCK_SIZE_K=96 (ratio 3) and crashes; Marlin refuses H % 128 != 0
    "gptq-gs32-k1344": dict(fmt="gptq", bits=4, group_size=32, hidden=1344, intermediate=256),
    # act order (random g_idx per expert, gate and up sharing one): triton and cuda run it sorted; the
    # attention stays float (vLLM 0.30+ refuses act order in linear layers)
    "gptq-desc-act": dict(
        fmt="gptq", bits=4, group_size=32, desc_act=True, quantize_attention=False, hidden=1024, intermediate=256
    ),
    "ct-actorder-group": dict(
        fmt="compressed-tensors",
        bits=4,
        group_size=64,
        desc_act=True,
        quantize_attention=False,
        hidden=1024,
        intermediate=256,
    ),
    "gptq-desc-act-asym-v2": dict(
        fmt="gptq",
        bits=4,
        group_size=64,
        sym=False,
        desc_act=True,
        checkpoint_format="gptq_v2",
        quantize_attention=False,
        hidden=1024,
        intermediate=256,
    ),
}
# (how the choice is passed, name): vLLM's --moe-backend names, then the plugin-only one
BACKENDS = [("moe_backend", "auto"), ("moe_backend", "triton"), ("moe_backend", "marlin"),
            ("moe_backend", "emulation"), ("env", "vllm_cuda"), ("env", "cuda")]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

    root = tmp_path_factory.mktemp("e2e-ck")
    made = {}

    def get(name):
        if name not in made:
            made[name] = make_checkpoint(root / name, experts=8, top_k=2, layers=2, **CHECKPOINTS[name])
        return made[name]

    return get


@pytest.fixture(scope="module")
def baseline(checkpoints, tmp_path_factory):
    runs = {}

    def get(name):
        if name not in runs:
            tmp = tmp_path_factory.mktemp(f"ref-{name}")
            runs[name] = run_llm(checkpoints(name), tmp, backend="reference", eager=True).require_ok(
                f"{name} reference"
            )
        return runs[name]

    return get


@pytest.fixture(scope="module", autouse=True)
def start_selected_runs(request, checkpoints, tmp_path_factory):
    """With E2E_JOBS > 1, start the LLM runs of every selected test in this module up front,
    references first; each test then waits for its own run and checks it as before."""
    if e2e_jobs() == 1:
        return
    params = [item.callspec.params for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")]  # fmt: skip
    names = [p["name"] for p in params]
    if any(item.name == "test_rotated_experts_do_not_generate_like_the_reference" for item in request.session.items):
        names.append(CONTROL)
        start_llm(rotated_checkpoint(checkpoints), tmp_path_factory.mktemp("rotated"), moe_backend="triton")
    for name in dict.fromkeys(names):
        start_llm(checkpoints(name), tmp_path_factory.mktemp(f"ref-{name}"), backend="reference", eager=True)
    for p in params:
        tmp = tmp_path_factory.mktemp(f"run-{p['name']}")
        if "backend" in p:
            key = "moe_backend" if p["how"] == "moe_backend" else "backend"
            start_llm(checkpoints(p["name"]), tmp, **{key: p["backend"]})
        else:
            start_llm(checkpoints(p["name"]), tmp, quantization=p["quantization"])


def record(tmp_path, **fields) -> None:
    path = os.environ.get("E2E_RECORD") or str(tmp_path.parent / "e2e-record.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps(fields) + "\n")
    print("E2E_RECORD", json.dumps(fields))


def _verdict(checkpoint, backend: str) -> str | None:
    """The plugin oracle's reason to refuse an explicit `backend` for this checkpoint on this GPU (None: it runs)."""
    import dataclasses

    from vllm_wna16_plugin.backends import RunOptions, registry
    from vllm_wna16_plugin.tools.demo import device_key
    from vllm_wna16_plugin.tools.doctor import layer_problem

    problem = layer_problem(checkpoint, device=device_key())
    problem = dataclasses.replace(problem, options=RunOptions(plan_only=True, explicit=True))
    return registry()["reference" if backend == "emulation" else backend].incompatibility_reason(problem)


@pytest.mark.parametrize("how,backend", BACKENDS, ids=[b for _, b in BACKENDS])
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_backend_generates_like_the_reference(checkpoints, baseline, tmp_path, name, how, backend):
    ckpt = checkpoints(name)
    kwargs = dict(moe_backend=backend) if how == "moe_backend" else dict(backend=backend)
    run = run_llm(ckpt, tmp_path, **kwargs)
    reason = None if backend == "auto" else _verdict(ckpt, backend)
    if reason is not None:
        # an explicit choice that cannot run fails at load, with the plugin's reason, not inside a kernel
        assert not run.ok, f"{name}: {backend} ran although the oracle rejects it: {reason}"
        assert "cannot run" in run.log and reason in run.log, run.log[-3000:]
        record(tmp_path, checkpoint=name, backend=backend, result="refused at load", reason=reason)
        pytest.skip(f"{backend} refuses {name}: {reason}")
    run.require_ok(f"{name} {backend}")
    assert "moe_wna16_plus: using backend" in run.log, "the oracle did not explain its choice"
    worst = assert_generates_like(run, baseline(name), f"{name} {backend}")
    record(tmp_path, checkpoint=name, backend=backend, result="agrees", seconds=round(run.result["seconds"], 1),
           max_logprob_diff=round(worst, 4), tokens=run.result["tokens"], text=run.result["text"],
           inspection_fallback=run.result.get("inspection_fallback"))  # fmt: skip


@pytest.mark.parametrize("quantization", ["moe_wna16", None], ids=["in-tree-moe_wna16", "in-tree-default"])
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_vllm_in_tree_paths_on_the_same_checkpoint(checkpoints, baseline, tmp_path, name, quantization):
    run = run_llm(checkpoints(name), tmp_path, quantization=quantization)
    label = quantization or "vLLM default"
    if not run.ok:
        record(tmp_path, checkpoint=name, path=label, result="crash", error=run.result.get("error"),
               error_type=run.result.get("error_type"))  # fmt: skip
        pytest.xfail(f"vLLM's {label} fails on {name}: {run.result.get('error')}")
    assert "moe_wna16_plus: using backend" not in run.log, "the plugin claimed a checkpoint nobody asked it for"
    worst = assert_generates_like(run, baseline(name), f"{name} vLLM {label}")
    record(tmp_path, checkpoint=name, path=label, result="agrees", seconds=round(run.result["seconds"], 1),
           max_logprob_diff=round(worst, 4))  # fmt: skip


CONTROL = "gptq-gs128"


def test_rotated_experts_do_not_generate_like_the_reference(checkpoints, baseline, tmp_path_factory):
    """The negative control: the agreement tolerances must be tight enough to catch a checkpoint read with its
    experts in the wrong order (run with the triton backend, as a user's would)."""
    run = run_llm(rotated_checkpoint(checkpoints), tmp_path_factory.mktemp("rotated"), moe_backend="triton")
    run.require_ok(f"{CONTROL} with rotated experts")
    why, worst = generation_disagreement(run.result, baseline(CONTROL).result)
    record(tmp_path_factory.getbasetemp(), checkpoint=f"{CONTROL}-rotated-experts", backend="triton",
           result="caught" if why else "NOT caught", why=why, max_logprob_diff=round(worst, 4))  # fmt: skip
    assert why is not None, f"rotated experts generated like the reference (largest log-prob difference {worst:.3g})"


_ROTATED: list[Path] = []


def rotated_checkpoint(checkpoints) -> Path:
    if not _ROTATED:
        src = checkpoints(CONTROL)
        _ROTATED.append(rotate_experts(src, src.parent / f"{CONTROL}-rotated-experts"))
    return _ROTATED[0]


def test_demo_generates_on_the_gpu(tmp_path):
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_wna16_plugin.tools.cli", "demo", "--out", str(tmp_path / "ck"),
         "--attention-backend", "TRITON_ATTN"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "backend on sm" in proc.stdout and "tok/s" in proc.stdout
    assert proc.stdout.count(" -> '") == 3, proc.stdout[-2000:]
