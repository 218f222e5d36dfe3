"""td_gate.decide_td: one test per rule (pure Python, no kernel)."""

import contextlib
import logging

import pytest

from vllm_wna16_plugin.kernels.triton import td_gate
from vllm_wna16_plugin.kernels.triton.td_gate import decide_td, td_request_from_env


def decide(**overrides):
    kwargs = dict(requested=True, platform="cuda", sm=100, block_size_m=16, block_size_k=64, M=16, K=2048)
    kwargs.update(overrides)
    return decide_td(**kwargs)


def both(d):
    return d.use_td_b, d.use_gather


@pytest.mark.parametrize(
    "platform,sm,want",
    [
        pytest.param("xpu", None, (True, True), id="xpu-load-and-gather"),
        pytest.param("cuda", 100, (True, True), id="sm100-gather4"),
        pytest.param("cuda", 120, (True, True), id="sm120"),
        pytest.param("cuda", 90, (True, False), id="sm90-tma-load-only"),  # H200: B via TMA, A on pointers
        pytest.param("cuda", 89, (False, False), id="sm89-no-tma"),
        pytest.param("cuda", 80, (False, False), id="sm80-no-tma"),
        pytest.param("cuda", None, (False, False), id="cuda-unknown-sm"),
        pytest.param("rocm", None, (False, False), id="rocm"),
        pytest.param("cpu", None, (False, False), id="cpu"),
        pytest.param("interpreter", None, (True, True), id="interpreter-forced"),
    ],
)
def test_forced_capability_per_platform(platform, sm, want):
    assert both(decide(platform=platform, sm=sm)) == want


def test_unknown_platform_raises():
    with pytest.raises(ValueError, match=r"platform='tpu' is not known"):
        decide(platform="tpu")


def test_disabled_is_off_everywhere():
    assert both(decide(requested=False, platform="xpu")) == (False, False)


@pytest.mark.parametrize(
    "platform,sm,config_use_td,want",
    [
        pytest.param("xpu", None, None, (True, True), id="xpu-auto-on"),
        pytest.param("cuda", 90, None, (False, False), id="sm90-auto-off-untuned"),
        pytest.param("cuda", 90, True, (True, False), id="sm90-auto-on-when-tuned"),
        pytest.param("cuda", 100, None, (False, False), id="sm100-auto-off-untuned"),
        pytest.param("cuda", 100, True, (True, True), id="sm100-auto-on-when-tuned"),
        pytest.param("cuda", 80, True, (False, False), id="sm80-tuned-cannot"),
        pytest.param("interpreter", None, None, (False, False), id="interpreter-auto-off"),
    ],
)
def test_auto_mode(platform, sm, config_use_td, want):
    assert both(decide(requested=None, platform=platform, sm=sm, config_use_td=config_use_td)) == want


def test_m1_single_row_no_td():
    d = decide(M=1)
    assert both(d) == (False, False) and "M == 1" in d.reason
    assert both(decide(M=2)) == (True, True)


def test_block_k_below_32_no_td():
    assert both(decide(block_size_k=16, K=2048)) == (False, False)
    assert both(decide(block_size_k=32, K=2048)) == (True, True)


@pytest.mark.parametrize(
    "platform,sm,want",
    [
        pytest.param("cuda", 100, (False, False), id="cuda-k-tail-off"),
        pytest.param("interpreter", None, (False, False), id="interpreter-k-tail-off"),
        pytest.param("xpu", None, (True, True), id="xpu-keeps-k-tail"),
    ],
)
def test_k_tail_only_on_xpu(platform, sm, want):
    # K=1344 with BLOCK_SIZE_K=128 leaves a 64-wide tail
    assert both(decide(platform=platform, sm=sm, K=1344, block_size_k=128)) == want


def test_gather_needs_8_rows_b_keeps_td():
    for bm in (1, 2, 4):
        d = decide(block_size_m=bm)
        assert both(d) == (True, False) and "BLOCK_SIZE_M" in d.reason
    assert both(decide(block_size_m=8)) == (True, True)


def test_unaligned_rows_or_pointers_no_td():
    # K=100 int4 on XPU: 50-byte rows cannot be a descriptor stride
    assert both(decide(platform="xpu", K=100, block_size_k=32)) == (False, False)
    # int8 K=1320: 1320-byte rows, not a multiple of 16
    assert both(decide(platform="xpu", K=1320, block_size_k=32, bits=8)) == (False, False)
    # int4 K=1344 (672-byte rows) and K=96 (48) are aligned: XPU keeps TD on their tails
    assert both(decide(platform="xpu", K=1344, block_size_k=128)) == (True, True)
    assert both(decide(platform="xpu", K=96, block_size_k=64)) == (True, True)
    # a base pointer off a 16-byte boundary (e.g. a sliced view)
    assert both(decide(aligned=False)) == (False, False)


@contextlib.contextmanager
def gate_log(caplog):
    """caplog's handler on the gate's logger, unless a record already reaches it.

    vLLM's `vllm` logger, the gate logger's parent, does not propagate to the root, where pytest
    attaches caplog. pytest 9.2 also attaches it to non-propagating loggers such as `vllm`; earlier
    ones did not. Attached twice, every record would be counted twice."""

    def reaches(logger) -> bool:
        while logger is not None:
            if caplog.handler in logger.handlers:
                return True
            logger = logger.parent if logger.propagate else None
        return False

    added = not reaches(td_gate.logger)
    if added:
        td_gate.logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger=td_gate.logger.name):
            yield
    finally:
        if added:
            td_gate.logger.removeHandler(caplog.handler)


def test_forced_refusal_logs_once_and_never_raises(caplog):
    td_gate._logged.clear()
    with gate_log(caplog):
        for _ in range(3):
            assert both(decide(platform="cuda", sm=80)) == (False, False)
    msgs = [r.getMessage() for r in caplog.records if "sm80" in r.getMessage()]
    assert len(msgs) == 1 and "pointer path" in msgs[0]


def test_auto_refusal_does_not_log(caplog):
    td_gate._logged.clear()
    with gate_log(caplog):
        decide(requested=None, platform="cuda", sm=80)
        decide(requested=None, platform="xpu", M=1)
    assert not caplog.records


@pytest.mark.parametrize(
    "value,want",
    [
        pytest.param(None, None, id="unset-auto"),
        pytest.param("", None, id="empty-auto"),
        pytest.param("1", True, id="force"),
        pytest.param("0", False, id="off"),
    ],
)
def test_env_request(value, want):
    env = {} if value is None else {td_gate.ENV_VAR: value}
    assert td_request_from_env(env) is want


def test_env_request_rejects_garbage():
    with pytest.raises(ValueError, match=r"VLLM_TRITON_USE_TD='maybe' is not understood"):
        td_request_from_env({td_gate.ENV_VAR: "maybe"})
    # the usual spellings, any case (as the plugin's other switches read them)
    for value, want in (("yes", True), (" TRUE ", True), ("On", True), ("no", False), ("OFF", False), ("", None)):
        assert td_request_from_env({td_gate.ENV_VAR: value}) is want, value


def test_launcher_reads_env_when_use_td_is_none(monkeypatch):
    # the launcher resolves use_td=None through the env var; explicit use_td wins
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    from vllm_wna16_plugin.kernels.triton import fused_moe

    seen = []
    monkeypatch.setattr(
        fused_moe, "decide_td", lambda **kw: seen.append(kw["requested"]) or td_gate.TDDecision(False, False, "spy")
    )
    monkeypatch.setattr(fused_moe, "invoke_wna16_gemm", lambda *a, **k: None)
    from .conftest import make_moe_problem

    p = make_moe_problem(M=2, H=64, inter=32, E=4, top_k=2, bits=4, gs1=32)
    monkeypatch.setenv(td_gate.ENV_VAR, "1")
    fused_moe.fused_moe_wna16_triton(*p.args(), **p.kwargs())
    fused_moe.fused_moe_wna16_triton(*p.args(), **p.kwargs(), use_td=False)
    assert seen == [True, True, False, False]
