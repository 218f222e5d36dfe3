"""Where the plugin's CUDA kernel beats its Triton kernel: measured crossovers, per layer shape and device.

`auto` takes the `cuda` backend for a layer only when this table has an entry for the layer's
shape on this device. The `cuda` backend then runs batches of up to `cuda_max_m` tokens and hands
larger ones to `triton`. Entries are measured, never guessed. `bench/bench_moe.py
--write-crossover` writes them from a run that timed plugin-cuda and plugin-triton side by side.
The entry is the largest M up to which cuda was faster at every measured M, starting from M=1. The
file is crossover/<device>.json; device spaces become underscores, e.g. NVIDIA_H200.json:

    {"E=128,H=2048,I=768,group_size=128,bits=4": {"cuda_max_m": 4, "source": "bench/results/h200/x.md"}}

group_size is -1 for channel-wise. No vLLM import here.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

CROSSOVER_DIR = Path(__file__).with_name("crossover")


def layer_key(num_experts: int, hidden: int, intermediate: int, group_size: int, bits: int) -> str:
    """The table key of one MoE layer shape (per rank); group_size -1 = channel-wise."""
    return f"E={num_experts},H={hidden},I={intermediate},group_size={group_size},bits={bits}"


def crossover_file(device_name: str, crossover_dir: Path | None = None) -> Path:
    return (crossover_dir or CROSSOVER_DIR) / f"{device_name.replace(' ', '_')}.json"


@functools.cache
def _load(path: Path) -> dict[str, dict]:
    if not path.is_file():
        return {}
    table = json.loads(path.read_text())
    for key, entry in table.items():
        m = entry.get("cuda_max_m") if isinstance(entry, dict) else None
        if not isinstance(m, int) or m < 0:
            raise ValueError(f"{path.name}: entry {key!r} needs a non-negative integer cuda_max_m, got {entry!r}")
    return table


def cuda_max_m(key: str, device_name: str | None, crossover_dir: Path | None = None) -> int:
    """The largest batch (tokens) for which `cuda` measured faster than `triton`; 0 = no entry."""
    if not device_name:
        return 0
    return int(_load(crossover_file(device_name, crossover_dir)).get(key, {}).get("cuda_max_m", 0))


def measured_crossover(times: dict[int, tuple[float, float]]) -> int:
    """{M: (cuda µs, triton µs)} -> the largest M such that cuda was faster at every measured M <= it
    (0 when it lost at the smallest M)."""
    best = 0
    for m in sorted(times):
        cuda_us, triton_us = times[m]
        if not cuda_us < triton_us:
            break
        best = m
    return best


def write_crossovers(entries: dict[str, dict], device_name: str, crossover_dir: Path | None = None) -> Path:
    """Merge {key: {"cuda_max_m": m, "source": ...}} into the device's file; returns its path."""
    path = crossover_file(device_name, crossover_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = json.loads(path.read_text()) if path.is_file() else {}
    table.update(entries)
    path.write_text(json.dumps(dict(sorted(table.items())), indent=2) + "\n")
    _load.cache_clear()
    return path


__all__ = ["CROSSOVER_DIR", "cuda_max_m", "layer_key", "measured_crossover", "write_crossovers"]
