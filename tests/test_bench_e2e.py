"""bench/e2e.py's table (CPU): every provider's row, the ratios against plugin-auto, failures shown."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def load_e2e():
    path = Path(__file__).resolve().parents[1] / "bench" / "e2e.py"
    spec = importlib.util.spec_from_file_location("wna16_e2e_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # it imports bench_moe from its own directory
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def test_table_ratios_failures_and_profiled_kernels():
    e2e = load_e2e()
    names = [w[0] for w in e2e.WORKLOADS]

    def run(provider, tok_s):
        return {"provider": provider, "ok": True, "startup_s": 5.0,
                "workloads": {n: {"output_tok_s": tok_s, "input_tok_s": 100 * tok_s} for n in names}}  # fmt: skip

    auto = run("plugin-auto", 300.0)
    auto["profiles"] = {
        "prefill": {"wall_ms": 150.0, "kernel_ms": 120.0,
                    "kernels": [{"kernel": "_fused_moe_wna16_kernel", "calls": 8, "ms": 12.5, "share": 0.4}]},
        "decode-bs64": {"wall_ms": 352.0, "kernel_ms": 299.0,
                        "kernels": [{"kernel": "humming", "calls": 1536, "ms": 30.25, "share": 0.21}],
                        "host_ops": [{"op": "cudaGraphLaunch", "calls": 127, "ms": 4.5}]},
    }  # fmt: skip
    table = e2e.render([auto, run("vllm-default", 200.0), {"provider": "vllm-moe_wna16", "ok": False,
                                                           "error": "ValueError: no"}], "# t")  # fmt: skip
    assert "| plugin-auto | 5 | 300 tok/s" in table
    assert "| vllm-default | " + " | ".join(["1.50"] * len(names)) + " |" in table  # 300 / 200
    assert "| vllm-moe_wna16 | failed: ValueError: no |" in table
    assert (
        "plugin-auto: one prefill pass under torch.profiler: 150 ms wall, 120 ms of kernels (the GPU waited 30 ms"
        in table
    )
    assert "| `_fused_moe_wna16_kernel` | 8 | 12.50 | 40% |" in table
    assert "plugin-auto: one decode-bs64 pass under torch.profiler: 352 ms wall, 299 ms of kernels" in table
    assert "| `cudaGraphLaunch` | 127 | 4.50 |" in table
    assert "| `humming` | 1536 | 30.25 | 21% |" in table


def test_a_checkpoint_is_reused_only_with_its_spec_and_included_runs_only_on_it(tmp_path):
    """--checkpoint: a directory holding make_checkpoint's checkpoint of the wanted spec is reused, one of another
    spec is refused by field (nothing overwritten), an empty one is written; --include refuses a run measured on
    another checkpoint."""
    import json

    import pytest

    from vllm_wna16_plugin.tools.make_checkpoint import CheckpointSpec, load_spec, make_checkpoint

    e2e = load_e2e()
    wanted = dict(fmt="gptq", bits=4, group_size=64, hidden=128, intermediate=64, experts=4, top_k=2, layers=2,
                  quantize_attention=False, float_reference=False)  # fmt: skip
    ckpt = tmp_path / "ck"
    assert not e2e.reusable(ckpt, wanted, load_spec, CheckpointSpec)
    make_checkpoint(ckpt, **wanted)
    assert e2e.reusable(ckpt, wanted, load_spec, CheckpointSpec)
    with pytest.raises(SystemExit, match=r"layers: 2 there, 3 wanted"):
        e2e.reusable(ckpt, {**wanted, "layers": 3}, load_spec, CheckpointSpec)
    with pytest.raises(SystemExit, match=r"seed: 0 there, 7 wanted"):  # a default field counts too
        e2e.reusable(ckpt, {**wanted, "seed": 7}, load_spec, CheckpointSpec)
    described = e2e.describe_checkpoint(wanted)
    run = tmp_path / "run.json"
    run.write_text(json.dumps([{"provider": "vllm-default", "ok": True, "checkpoint": described, "setting": "H100"}]))
    assert [r["provider"] for r in e2e.read_included(run, described, "H100")] == ["vllm-default"]
    with pytest.raises(SystemExit, match=r"not this run's checkpoint"):
        e2e.read_included(run, e2e.describe_checkpoint({**wanted, "layers": 3}), "H100")
    with pytest.raises(SystemExit, match=r"not this run's setting"):
        e2e.read_included(run, described, "H200")


def test_merged_rows_keep_one_per_provider_and_a_failure_never_replaces_a_good_row():
    e2e = load_e2e()
    good, failed = {"provider": "plugin-auto", "ok": True, "n": 1}, {"provider": "plugin-auto", "ok": False}
    newer = {"provider": "plugin-auto", "ok": True, "n": 2}
    other = {"provider": "vllm-default", "ok": True}
    assert e2e.merged([good], [failed, other]) == [good, other]
    assert e2e.merged([good, other], [newer]) == [newer, other]
    assert e2e.merged([failed], [good]) == [good]
