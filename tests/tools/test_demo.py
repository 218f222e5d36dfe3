"""vllm-wna16 demo without a GPU: the README's command, run as a newcomer runs it.

Each run is a subprocess with no visible GPU (vLLM's distributed state is per process).
On CPU the demo builds the checkpoint's MoE layers through vLLM's FusedMoE weight
loader and checks each one against float math on the dequantized experts. The tests
check that a correct checkpoint passes, that a corrupted one fails, and that a backend
that cannot run gives a message and not a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_wna16_plugin.tools.demo import CPU_TOLERANCE, device_key
from vllm_wna16_plugin.tools.make_checkpoint import MODEL_FILE, make_checkpoint

pytestmark = pytest.mark.slow


def run_demo(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="0", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "vllm_wna16_plugin.tools.cli", "demo", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_demo_default_checkpoint_runs_every_moe_layer_on_cpu(tmp_path):
    proc = run_demo("--out", str(tmp_path / "ck"))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    # the default checkpoint is GPTQ int4 gs32 with K=2048 (vLLM's crash shape), planned for this machine
    assert "scheme: gptq int4 group 32 symmetric" in out and "gate/up  K=  2048" in out
    assert "backend on cpu (auto): reference" in out and "no CUDA GPU found" in out
    for layer in (0, 1):
        assert f"layer {layer + 1}/2 model.layers.{layer}.mlp.experts: backend 'reference'" in out
    results = [line for line in out.splitlines() if "max error" in line]
    assert len(results) == 2 and all(line.endswith(": ok") for line in results), results
    assert out.count("backend on cpu (auto)") == 1 and out.count("- triton: rejected") == 1  # the plan, once
    assert "2/2 MoE layers match the float reference: OK" in out
    assert f"checkpoint kept at {tmp_path / 'ck'}" not in out and (tmp_path / "ck" / MODEL_FILE).exists()  # --out


def test_demo_removes_its_temporary_checkpoint_unless_kept(tmp_path):
    env_tmp = dict(TMPDIR=str(tmp_path))
    proc = run_demo("--hidden", "256", "--layers", "1", env=env_tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "removed the temporary checkpoint" in proc.stdout and not list(tmp_path.glob("wna16-demo-*"))
    proc = run_demo("--hidden", "256", "--layers", "1", "--keep", env=env_tmp)
    kept = list(tmp_path.glob("wna16-demo-*"))
    assert proc.returncode == 0 and len(kept) == 1 and f"checkpoint kept at {kept[0]}" in proc.stdout
    assert proc.stderr.count("WARNING") == 0, proc.stderr  # vLLM's no-GPU notes are not shown


def test_demo_catches_a_corrupted_checkpoint(tmp_path):
    # Swap two experts' gate weights on disk. The layer still loads, but its output no longer matches
    # the float math on the experts the checkpoint was made from.
    path = make_checkpoint(tmp_path / "ck", fmt="gptq", bits=4, group_size=32, hidden=256, intermediate=128,
                           experts=4, top_k=2, layers=1, seed=3)  # fmt: skip
    tensors = load_file(str(path / MODEL_FILE))
    a, b = (f"model.layers.0.mlp.experts.{e}.gate_proj.qweight" for e in (0, 1))
    tensors[a], tensors[b] = tensors[b], tensors[a]
    save_file(tensors, str(path / MODEL_FILE), metadata={"format": "pt"})
    proc = run_demo("--checkpoint", str(path), "--cpu")
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert f"FAILED (tolerance {CPU_TOLERANCE:.3g})" in proc.stdout


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The demo's one error line (stderr, last line); fails on a traceback, exit status other than 2, or more."""
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "error:" in line]
    assert len(lines) == 1 and proc.stderr.splitlines()[-1] == lines[0], proc.stdout[-2000:] + proc.stderr[-3000:]
    assert lines[0].startswith("vllm-wna16 demo: error: "), lines[0]
    return lines[0]


def test_demo_explicit_backend_that_cannot_run_names_the_flag(tmp_path):
    proc = run_demo("--out", str(tmp_path / "ck"), "--hidden", "256", "--layers", "1", "--backend", "marlin")
    line = error_line(proc)
    assert "moe_wna16_plus: backend 'marlin' (--backend) cannot run" in line  # the flag typed, not the env var
    assert "Backends that would work: ['reference']" in line
    assert not (tmp_path / "ck").exists()  # refused before anything was written


def test_demo_triton_on_cpu_says_how_to_run_it(tmp_path):
    line = error_line(run_demo("--out", str(tmp_path / "ck"), "--hidden", "256", "--backend", "triton"))
    assert "backend 'triton' (--backend) cannot run" in line and "TRITON_INTERPRET=1" in line
    assert not (tmp_path / "ck").exists()


def test_demo_rejects_a_bad_shape_before_running(tmp_path):
    line = error_line(run_demo("--out", str(tmp_path / "ck"), "--hidden", "250"))
    assert line.endswith("error: --hidden 250 must be a positive multiple of 32")
    assert not (tmp_path / "ck").exists()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("demo") / "ck", fmt="gptq", bits=4, group_size=32, hidden=256,
                           intermediate=128, experts=4, top_k=2, layers=1, seed=5)  # fmt: skip


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _truncate(path):
    data = (path / MODEL_FILE).read_bytes()
    (path / MODEL_FILE).write_bytes(data[: len(data) * 2 // 3])


def _garble(path):
    (path / MODEL_FILE).write_bytes(torch.randint(0, 256, (8192,), generator=torch.Generator().manual_seed(0),
                                                  dtype=torch.uint8).numpy().tobytes())  # fmt: skip


def _break_config(path):
    text = (path / "config.json").read_text()
    (path / "config.json").write_text(text[: len(text) // 2])


@pytest.mark.parametrize(
    "corrupt, expected",
    [
        pytest.param(_truncate, f"{MODEL_FILE}: not a readable safetensors file (Error while deserializing header: "
                     "incomplete metadata, file not fully covered)", id="truncated"),
        pytest.param(_garble, f"{MODEL_FILE}: not a readable safetensors file (Error while deserializing header",
                     id="garbage-bytes"),
        pytest.param(_break_config, "config.json", id="broken-config-json"),
        pytest.param(lambda path: shutil.rmtree(path), "config.json: No such file or directory", id="missing-dir"),
        pytest.param(lambda path: (path / "reference" / "reference.safetensors").unlink(),
                     "is not a make_checkpoint directory", id="no-reference"),
        pytest.param(lambda path: (path / "tokenizer.json").unlink(), "tokenizer.json: cannot load the tokenizer",
                     id="no-tokenizer"),
    ],
)  # fmt: skip
def test_demo_bad_checkpoint_files_are_one_line(tiny, tmp_path, corrupt, expected):
    path = _copy(tiny, tmp_path / "ck")
    corrupt(path)
    line = error_line(run_demo("--checkpoint", str(path), "--cpu"))
    assert expected in line, line


def test_demo_corrupted_scale_bytes_are_named_at_load(tiny, tmp_path):
    # Bit rot inside the data: one fp16 scale of a random expert becomes 0xFFFF (NaN). The header is intact,
    # so the file opens; load-time validation names the tensor, its expert and layer.
    path = _copy(tiny, tmp_path / "ck")
    gen = torch.Generator().manual_seed(3)
    expert, proj = (
        int(torch.randint(4, (1,), generator=gen)),
        ("gate_proj", "up_proj", "down_proj")[int(torch.randint(3, (1,), generator=gen))],
    )
    name = f"model.layers.0.mlp.experts.{expert}.{proj}.scales"
    raw = bytearray((path / MODEL_FILE).read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    info = json.loads(raw[8 : 8 + header_len])[name]
    assert info["dtype"] == "F16"
    begin, end = info["data_offsets"]
    element = int(torch.randint((end - begin) // 2, (1,), generator=gen))
    at = 8 + header_len + begin + 2 * element
    raw[at : at + 2] = b"\xff\xff"
    (path / MODEL_FILE).write_bytes(bytes(raw))
    group, channel = divmod(element, info["shape"][1])  # GPTQ scales are (G, N)
    line = error_line(run_demo("--checkpoint", str(path), "--cpu"))
    assert (
        f"checkpoint tensor {name} (expert {expert} of model.layers.0.mlp.experts): scale nan at output channel "
        f"{channel}, group {group} is not finite"
    ) in line


def test_device_key_on_cpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert device_key() == "cpu"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--prompt", " "], "argument --prompt: an empty prompt has no tokens"),  # was an IndexError traceback
        (["--max-tokens", "0"], "argument --max-tokens: 0 must be at least 1"),
        (["--gpu-memory-utilization", "5"], "argument --gpu-memory-utilization: 5.0 must be in (0, 1]"),
    ],
)
def test_demo_flags_out_of_range_are_usage_errors(flags, message, capsys):
    from vllm_wna16_plugin.tools.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["demo", *flags])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--checkpoint", ""], "argument --checkpoint: an empty path names no directory"),
        (["--out", " "], "argument --out: an empty path names no directory"),
        (["--out", "a", "--checkpoint", "b"], "argument --checkpoint: not allowed with argument --out"),
    ],
)
def test_demo_path_flags_that_name_no_directory_are_usage_errors(capsys, argv, message):
    """`--checkpoint ''` ran the default demo instead, and `--out ''` wrote a temporary checkpoint and removed it;
    --out beside --checkpoint was ignored (a bad-input sweep). Refused by argparse, before vLLM is touched."""
    from vllm_wna16_plugin.tools.cli import EXIT_ERROR, main

    with pytest.raises(SystemExit) as exit_:
        main(["demo", *argv])
    assert exit_.value.code == EXIT_ERROR
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith(f"vllm-wna16 demo: error: {message}")
