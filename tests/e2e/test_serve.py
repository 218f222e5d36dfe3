"""`vllm serve` with --quantization moe_wna16_plus --moe-backend triton (GPU only).

Starts the OpenAI server on a tiny checkpoint (port on 127.0.0.1), waits for /health, sends
completion and chat requests (8 at once, bounded), and checks the completions against offline
greedy generation of the same model. Then it stops the server with SIGINT and waits for it to
exit by itself.
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
    AGREE_MIN,
    PROMPTS,
    SHARED_GPU_MEMORY,
    agreed_prefix,
    first_errors,
    free_port,
    requires_gpu,
    run_llm,
)
from tests.e2e.llm_runner import COMPILATION

pytestmark = [pytest.mark.gpu, requires_gpu]
MAX_TOKENS = 16


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


def test_completions_equal_offline_greedy_also_concurrently(server, offline):
    base, _, _ = server

    def complete(prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "return_token_ids": True}  # fmt: skip
        return post(f"{base}/v1/completions", body)["choices"][0]["token_ids"]

    def agree(served: list[list[int]], what: str) -> None:
        # batches of other sizes run other kernel configs: a late near-tie of random weights may flip
        for i, (want, got) in enumerate(
            zip(offline.result["tokens"] * (len(served) // len(PROMPTS)), served, strict=True)
        ):
            assert agreed_prefix(want, got) >= min(AGREE_MIN, len(want)), f"{what} request {i}: {got} vs offline {want}"

    agree([complete(p) for p in PROMPTS], "sequential")
    with ThreadPoolExecutor(max_workers=8) as pool:  # 8 requests in flight, 24 in all
        agree(list(pool.map(complete, PROMPTS * 8)), "concurrent")


def test_chat_completion_answers(server):
    base, _, _ = server
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": MAX_TOKENS,
            "temperature": 0.0}  # fmt: skip
    first = post(f"{base}/v1/chat/completions", body)
    again = post(f"{base}/v1/chat/completions", body)
    text = first["choices"][0]["message"]["content"]
    assert first["usage"]["completion_tokens"] > 0 and text == again["choices"][0]["message"]["content"]


def test_server_shuts_down_cleanly(server):
    # last in this module (pytest runs tests in file order): SIGINT, then the server exits by itself
    _, proc, log_path = server
    os.killpg(proc.pid, signal.SIGINT)
    rc = proc.wait(timeout=60)
    assert rc in (0, -signal.SIGINT, 130), f"exit code {rc}\n{log_path.read_text()[-2000:]}"


def test_offline_and_served_tokens_agree_with_reference(checkpoint, offline, tmp_path):
    ref = run_llm(checkpoint, tmp_path, backend="reference", eager=True, max_tokens=MAX_TOKENS).require_ok("ref")
    for r, g in zip(ref.result["tokens"], offline.result["tokens"], strict=True):
        assert agreed_prefix(r, g) >= min(8, len(r))
