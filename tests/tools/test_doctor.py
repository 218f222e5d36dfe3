"""vllm-wna16 doctor: the plan from config.json alone, and the same clear error loading would give."""

from __future__ import annotations

import json

import pytest

from vllm_wna16_plugin.tools.cli import main
from vllm_wna16_plugin.tools.doctor import plan
from vllm_wna16_plugin.tools.make_checkpoint import make_checkpoint


@pytest.fixture(scope="module")
def gs32_k2048(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("doc") / "ck", fmt="gptq", bits=4, group_size=32, hidden=2048,
                           intermediate=256, experts=8, top_k=2, layers=1)  # fmt: skip


def test_doctor_shows_legal_configs_and_vllms_illegal_ones(gs32_k2048):
    text = plan(gs32_k2048, tp=1, device="sm90")
    assert "gptq int4 group 32 symmetric" in text
    assert "gate/up  K=  2048" in text
    # vLLM 0.26 picks BLOCK_SIZE_K=512 (ratio 16) for gs32, K=2048 at small batch; ours is legal.
    assert "ILLEGAL (ratio 16) -> crash" in text
    for line in text.splitlines():
        if " M=" in line and " ok" in line:
            bk = int(line.split(":")[1].split()[0].split("/")[2])
            assert bk % 32 == 0 and bk // 32 in (1, 2, 4, 8), line


@pytest.mark.parametrize(
    "device, chosen",
    [("sm90", "triton"), ("cpu", "reference"), ("sm70", "triton")],
)
def test_doctor_names_the_backend_and_every_rejection(gs32_k2048, device, chosen):
    text = plan(gs32_k2048, tp=2, device=device)
    assert f"backend on {device} (auto): {chosen}" in text
    if device == "cpu":
        assert "marlin: rejected: needs an NVIDIA GPU" in text


def test_doctor_tp_split_regroups_or_refuses(tmp_path):
    path = make_checkpoint(tmp_path / "ck", fmt="gptq", bits=4, group_size=128, hidden=256, intermediate=768,
                           experts=4, top_k=2, layers=1)  # fmt: skip
    assert "K=    96" in plan(path, tp=8) and "re-grouped exactly" in plan(path, tp=8)
    with pytest.raises(ValueError, match="TP"):
        plan(path, tp=7)


def test_doctor_prints_the_config_error_and_exits_2(gs32_k2048, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((gs32_k2048 / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 3
    (bad / "config.json").write_text(json.dumps(cfg))
    assert main(["doctor", str(bad)]) == 2
    assert "bits=3" in capsys.readouterr().out


def test_layer_problem_is_the_planned_rank(gs32_k2048):
    from vllm_wna16_plugin.tools.doctor import layer_problem

    p = layer_problem(gs32_k2048, tp=2, device="sm90")
    assert (p.hidden, p.intermediate, p.num_experts, p.top_k) == (2048, 128, 8, 2)
    assert (p.group_size_w13, p.group_size_w2, p.platform, p.sm) == (32, 32, "cuda", 90)
