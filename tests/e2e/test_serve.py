"""`vllm serve` with --quantization moe_wna16_plus --moe-backend triton (GPU only).

Starts the OpenAI server on a tiny checkpoint (port on 127.0.0.1), waits for /health, sends
completion and chat requests (8 at once, bounded), and checks the completions against offline
greedy generation of the same model under the project's agreement rule (conftest): requests
batched with others, or whose prompt is already in vLLM's prefix cache, run other batch sizes
and so other kernel configs, and greedy decoding of random weights may then flip a near-tie.
The served top log-probs (as token ids) let the rule tell such a flip from a wrong result.
Then it stops the server with SIGINT and waits for it to exit by itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.conftest import (
    PROMPTS,
    SHARED_GPU_MEMORY,
    first_errors,
    free_port,
    generation_disagreement,
    requires_gpu,
    run_llm,
)
from tests.e2e.llm_runner import COMPILATION

pytestmark = [pytest.mark.gpu, requires_gpu]
MAX_TOKENS = 16
TOP_LOGPROBS = 5  # as llm_runner's offline runs


def token_id(name: str) -> str:
    """'token_id:59' (vLLM's `return_tokens_as_token_ids`) -> '59', the key llm_runner's log-probs use."""
    assert name.startswith("token_id:"), name
    return name.removeprefix("token_id:")


def completion_run(choice: dict) -> dict:
    """A served completion as llm_runner records a run: token ids and each step's top log-probs."""
    lp = choice["logprobs"]
    steps = []
    for tok, tok_lp, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        step = {token_id(t): float(v) for t, v in (top or {}).items()}
        if tok_lp is not None:
            step[token_id(tok)] = float(tok_lp)  # the chosen token, as vLLM adds it offline
        steps.append(step)
    return {"tokens": choice["token_ids"], "step_logprobs": steps}


def chat_run(choice: dict) -> dict:
    """A served chat answer as llm_runner records a run (token ids from the log-prob entries)."""
    content = choice["logprobs"]["content"]
    steps = []
    for entry in content:
        step = {token_id(t["token"]): float(t["logprob"]) for t in entry["top_logprobs"]}
        step[token_id(entry["token"])] = float(entry["logprob"])
        steps.append(step)
    return {"tokens": [int(token_id(e["token"])) for e in content], "step_logprobs": steps}


def agree(got: dict, want: dict, what: str) -> None:
    why, _ = generation_disagreement(got, want)
    assert why is None, f"{what}: {why}"


def post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("serve") / "gptq-gs32", fmt="gptq", bits=4, group_size=32,
                           hidden=2048, intermediate=256, experts=8, top_k=2, layers=2)  # fmt: skip


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve-log") / "serve.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(checkpoint),
           "--quantization", "moe_wna16_plus", "--moe-backend", "triton", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "256", "--max-num-seqs", "8", *SHARED_GPU_MEMORY,
           "--attention-backend", "TRITON_ATTN", "--served-model-name", "tiny",
           # the offline runs' compilation (llm_runner): no torch.compile, full CUDA graphs for decode
           "--compilation-config", json.dumps(COMPILATION)]  # fmt: skip
    env = dict(os.environ, TRITON_INTERPRET="0")
    env.pop("VLLM_WNA16_PLUS_BACKEND", None)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"vllm serve exited with {proc.returncode}\n{first_errors(log_path.read_text())}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.time() > deadline:
                raise AssertionError(f"vllm serve not healthy after 600 s\n{log_path.read_text()[-3000:]}")
            time.sleep(2)
        yield base, proc, log_path
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def offline(checkpoint, tmp_path_factory):
    run = run_llm(checkpoint, tmp_path_factory.mktemp("offline"), moe_backend="triton", max_tokens=MAX_TOKENS)
    return run.require_ok("offline triton")


def test_server_logs_the_plugins_backend(server):
    _, _, log_path = server
    assert "moe_wna16_plus: using backend 'triton' (--moe-backend: triton)" in log_path.read_text()


def test_completions_agree_with_offline_greedy_also_concurrently(server, offline):
    base, _, _ = server

    def complete(prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "return_token_ids": True, "logprobs": TOP_LOGPROBS, "return_tokens_as_token_ids": True}  # fmt: skip
        return completion_run(post(f"{base}/v1/completions", body)["choices"][0])

    def check(served: list[dict], what: str) -> None:
        for i, got in enumerate(served):
            want = {k: [offline.result[k][i % len(PROMPTS)]] for k in ("tokens", "step_logprobs")}
            agree({k: [got[k]] for k in want}, want, f"{what} request {i} against offline")

    check([complete(p) for p in PROMPTS], "sequential")
    with ThreadPoolExecutor(max_workers=8) as pool:  # 8 requests in flight, 24 in all
        check(list(pool.map(complete, PROMPTS * 8)), "concurrent")


def test_chat_completion_answers_alike_twice(server):
    # the second request finds its prompt in the prefix cache: a prefill of other size, same rule
    base, _, _ = server
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "logprobs": True, "top_logprobs": TOP_LOGPROBS,
            "return_tokens_as_token_ids": True}  # fmt: skip
    first = post(f"{base}/v1/chat/completions", body)
    again = post(f"{base}/v1/chat/completions", body)
    assert first["usage"]["completion_tokens"] > 0 and first["choices"][0]["message"]["content"]
    want, got = (chat_run(r["choices"][0]) for r in (first, again))
    agree({k: [v] for k, v in got.items()}, {k: [v] for k, v in want.items()}, "the same chat request twice")


def test_server_shuts_down_cleanly(server):
    # last in this module (pytest runs tests in file order): SIGINT, then the server exits by itself
    _, proc, log_path = server
    os.killpg(proc.pid, signal.SIGINT)
    rc = proc.wait(timeout=60)
    assert rc in (0, -signal.SIGINT, 130), f"exit code {rc}\n{log_path.read_text()[-2000:]}"


def test_offline_tokens_agree_with_reference(checkpoint, offline, tmp_path):
    ref = run_llm(checkpoint, tmp_path, backend="reference", eager=True, max_tokens=MAX_TOKENS).require_ok("ref")
    agree(offline.result, ref.result, "offline triton against the reference backend")
