"""The end-to-end agreement rule (conftest.generation_disagreement) and the expert-rotation control,
on CPU: the GPU tier is only as strict as these say."""

from __future__ import annotations

import random

import pytest
import torch

from tests.e2e.conftest import FIRST_STEP_LOGPROB_ATOL, LOGPROB_ATOL, generation_disagreement


def fake_run(steps: int = 6, prompts: int = 2, seed: int = 0) -> dict:
    """An llm_runner result: greedy tokens and each step's top-5 log-probs (the chosen token first)."""
    rng = random.Random(seed)
    tokens, logprobs = [], []
    for _ in range(prompts):
        toks, lps = [], []
        for _ in range(steps):
            cands = rng.sample(range(500), 5)
            top = sorted((-rng.uniform(0.1, 6.0) for _ in cands), reverse=True)
            toks.append(cands[0])
            lps.append({str(t): v for t, v in zip(cands, top, strict=True)})
        tokens.append(toks)
        logprobs.append(lps)
    return {"tokens": tokens, "step_logprobs": logprobs}


def copy(run: dict) -> dict:
    return {
        "tokens": [list(t) for t in run["tokens"]],
        "step_logprobs": [[dict(s) for s in p] for p in run["step_logprobs"]],
    }


def test_identical_runs_agree_with_zero_difference():
    ref = fake_run()
    assert generation_disagreement(copy(ref), ref) == (None, 0.0)


def test_small_logprob_noise_agrees_and_reports_the_largest_difference():
    ref, got = fake_run(), None
    got = copy(ref)
    got["step_logprobs"][1][3] = {t: v + 0.3 for t, v in got["step_logprobs"][1][3].items()}
    why, worst = generation_disagreement(got, ref)
    assert why is None and worst == pytest.approx(0.3)


def test_logprobs_beyond_the_tolerance_disagree_even_with_equal_tokens():
    ref = fake_run()
    got = copy(ref)
    got["step_logprobs"][0][2] = {t: v - 2 * LOGPROB_ATOL for t, v in got["step_logprobs"][0][2].items()}
    why, _ = generation_disagreement(got, ref)
    assert why is not None and "step 2" in why


def test_the_first_step_has_the_tighter_tolerance():
    ref = fake_run()
    between = (FIRST_STEP_LOGPROB_ATOL + LOGPROB_ATOL) / 2
    for step, agrees in ((0, False), (3, True)):
        got = copy(ref)
        got["step_logprobs"][1][step] = {t: v + between for t, v in got["step_logprobs"][1][step].items()}
        why, worst = generation_disagreement(got, ref)
        assert (why is None) == agrees and worst == pytest.approx(between), (step, why)


def near_tie_flip(ref: dict, prompt: int, step: int, margin: float) -> dict:
    """`ref` whose run picks the reference's second token at `step` (its log-prob raised by `margin`
    above the first), then goes its own way."""
    got = copy(ref)
    lp = dict(ref["step_logprobs"][prompt][step])
    first, second = list(lp)[:2]
    lp[second] = lp[first] + margin
    got["step_logprobs"][prompt][step] = lp
    tail = fake_run(seed=99)["tokens"][0]
    got["tokens"][prompt] = ref["tokens"][prompt][:step] + [int(second)] + tail[: len(ref["tokens"][prompt]) - step - 1]
    return got


def test_a_flip_on_a_near_tie_agrees():
    ref = fake_run()
    lp = ref["step_logprobs"][1][4]
    first, second = list(lp)[:2]
    lp[second] = lp[first] - 0.05  # the reference's top two are 0.05 apart
    got = near_tie_flip(ref, 1, 4, 0.01)
    assert generation_disagreement(got, ref)[0] is None


def test_a_flip_that_is_not_a_near_tie_disagrees():
    ref = fake_run()
    lp = ref["step_logprobs"][1][4]
    first, second = list(lp)[:2]
    lp[second] = lp[first] - 3.0
    why, _ = generation_disagreement(near_tie_flip(ref, 1, 4, 0.01), ref)
    assert why is not None and "step 4" in why


def test_a_divergence_to_a_token_outside_the_references_top_disagrees():
    ref = fake_run()
    got = copy(ref)
    got["tokens"][0][2] = 777  # not among the reference's top log-probs at that step
    got["step_logprobs"][0][2] = {"777": -0.1, **got["step_logprobs"][0][2]}
    why, _ = generation_disagreement(got, ref)
    assert why is not None and "near-tie" in why


def test_a_run_that_stops_early_disagrees():
    ref = fake_run()
    got = copy(ref)
    got["tokens"][0] = got["tokens"][0][:3]
    got["step_logprobs"][0] = got["step_logprobs"][0][:3]
    assert generation_disagreement(got, ref)[0] is not None


def test_rotate_experts_moves_every_expert_one_down(tmp_path):
    from safetensors.torch import load_file

    from tests.e2e.conftest import rotate_experts
    from vllm_wna16_plugin.tools.make_checkpoint import MODEL_FILE, make_checkpoint

    src = make_checkpoint(tmp_path / "ck", fmt="gptq", bits=4, group_size=32, hidden=128, intermediate=64,
                          experts=4, top_k=2, layers=2, seed=3)  # fmt: skip
    dst = rotate_experts(src, tmp_path / "rotated")
    before, after = load_file(src / MODEL_FILE), load_file(dst / MODEL_FILE)
    assert before.keys() == after.keys()
    moved = 0
    for key, value in after.items():
        if ".experts." not in key:
            assert torch.equal(value, before[key]), key
            continue
        head, rest = key.split(".experts.")
        e, tail = rest.split(".", 1)
        assert torch.equal(value, before[f"{head}.experts.{(int(e) + 1) % 4}.{tail}"]), key
        moved += 1
    assert moved >= 2 * 4 * 3  # layers x experts x (gate, up, down) tensors at least


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_dequantize_attention_stores_the_float_weights_of_the_gptq_attention(tmp_path, checkpoint_format):
    """The float twin of the asymmetric GPTQ e2e test: attention as (q - zero) * scale, read here bit by bit
    (GPTQ: qweight packed along K, qzeros along N, v1 storing zero - 1), and nothing else changed."""
    import json

    from safetensors.torch import load_file

    from tests.e2e.conftest import dequantize_attention
    from tests.test_gptq_linear import _unpack
    from vllm_wna16_plugin.checkpoint_config import parse_quantization_config
    from vllm_wna16_plugin.tools.make_checkpoint import MODEL_FILE, make_checkpoint

    src = make_checkpoint(tmp_path / "ck", fmt="gptq", bits=4, group_size=32, sym=False, hidden=128, intermediate=64,
                          experts=4, top_k=2, layers=2, checkpoint_format=checkpoint_format)  # fmt: skip
    dst = dequantize_attention(src, tmp_path / "twin")
    before, after = load_file(src / MODEL_FILE), load_file(dst / MODEL_FILE)
    for key, value in after.items():
        if ".self_attn." not in key or "_norm" in key:
            assert torch.equal(value, before[key]), key
    offset = 1 if checkpoint_format == "gptq" else 0
    for li in range(2):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            p = f"model.layers.{li}.self_attn.{proj}"
            assert not any(f"{p}.{s}" in after for s in ("qweight", "qzeros", "scales", "g_idx"))
            q = _unpack(before[f"{p}.qweight"], 4, 0)  # (K, N)
            zeros = _unpack(before[f"{p}.qzeros"], 4, 1) + offset  # (G, N)
            group = torch.arange(q.shape[0]) // 32
            w = ((q - zeros[group]).float() * before[f"{p}.scales"].float()[group]).T
            assert after[f"{p}.weight"].dtype == torch.bfloat16 and torch.equal(after[f"{p}.weight"], w.bfloat16())
    parsed = parse_quantization_config(json.loads((dst / "config.json").read_text())["quantization_config"])
    assert parsed.scheme_for("model.layers.0.self_attn.qkv_proj", moe=False) is None
    assert parsed.scheme_for("model.layers.0.mlp.experts", moe=True).has_zero_point


def test_a_reload_run_is_its_own_run_and_tells_the_runner_what_to_reload(tmp_path):
    """conftest._llm_spec: reload_from reaches llm_runner's spec and the run's tag (so a reload run is never
    mistaken for the plain run of the same checkpoint by start_llm / run_llm), and nothing else changes."""
    from tests.e2e.conftest import _key, _llm_spec

    tag, spec, _ = _llm_spec(tmp_path / "a", backend="cuda")
    rtag, rspec, _ = _llm_spec(tmp_path / "a", backend="cuda", reload_from=tmp_path / "b")
    assert "reload_from" not in spec and rspec.pop("reload_from") == str(tmp_path / "b") and rspec == spec
    assert rtag == f"{tag}-reload-b"
    assert _key(tmp_path / "a", backend="cuda") != _key(tmp_path / "a", backend="cuda", reload_from=tmp_path / "b")
