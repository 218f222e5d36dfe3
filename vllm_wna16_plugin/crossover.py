"""Where the plugin's CUDA kernel beats its Triton kernel: measured crossovers, per layer shape and device.

`auto` takes the `cuda` backend for a layer only when this table has a winning range for the
layer's shape on this device. The `cuda` backend then runs the batches whose token count lies in
one of its ranges and hands the others to `triton`. Entries are measured, never guessed:
`bench/bench_moe.py --write-crossover` writes them from a run that timed plugin-cuda and
plugin-triton side by side. A range [lo, hi] is a run of consecutive measured M (lo and hi
measured) at each of which cuda was at least MIN_GAIN faster; between two measured M inside a range cuda is assumed
to stay ahead, and nothing is assumed outside the measured M. The file is crossover/<device>.json;
device spaces become underscores, e.g. NVIDIA_H200.json:

    {"E=128,H=2816,I=704,group_size=-1,bits=4": {"cuda_m_ranges": [[4, 32]], "source": "bench/results/h200/x.md"}}

An older entry {"cuda_max_m": m} means the range [1, m] (none when m is 0). group_size is -1 for
channel-wise. No vLLM import here.
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
    if not isinstance(table, dict):
        raise ValueError(f"{path.name}: a crossover table is a JSON object of layer keys, not {type(table).__name__}")
    for key, entry in table.items():
        if not isinstance(entry, dict):
            raise ValueError(f"{path.name}: entry {key!r} must be an object with cuda_m_ranges, got {entry!r}")
        table[key] = {**entry, "cuda_m_ranges": _entry_ranges(path.name, key, entry)}
    return table


def _entry_ranges(file: str, key: str, entry) -> list[tuple[int, int]]:
    if isinstance(entry, dict) and "cuda_m_ranges" in entry:
        ranges = entry["cuda_m_ranges"]
        ok = isinstance(ranges, list) and all(
            isinstance(r, list | tuple) and len(r) == 2 and all(isinstance(v, int) for v in r) and 1 <= r[0] <= r[1]
            for r in ranges
        )
        if not ok:
            raise ValueError(f"{file}: entry {key!r} needs cuda_m_ranges as [[lo, hi], ...] with 1 <= lo <= hi")
        return [(int(lo), int(hi)) for lo, hi in ranges]
    m = entry.get("cuda_max_m") if isinstance(entry, dict) else None
    if not isinstance(m, int) or m < 0:
        raise ValueError(
            f"{file}: entry {key!r} needs cuda_m_ranges or a non-negative integer cuda_max_m, got {entry!r}"
        )
    return [(1, m)] if m else []


def cuda_m_ranges(key: str, device_name: str | None, crossover_dir: Path | None = None) -> tuple[tuple[int, int], ...]:
    """The token-count ranges [lo, hi] in which `cuda` measured faster than `triton`; () = no entry."""
    if not device_name:
        return ()
    return tuple(_load(crossover_file(device_name, crossover_dir)).get(key, {}).get("cuda_m_ranges", ()))


def _user_table(device) -> tuple[dict[str, dict], Path | None]:
    """The user's own tuned crossover table for the device ({} where there is none or it is damaged)."""
    from vllm_wna16_plugin.user_tables import crossover_dir, read_safely

    mine = crossover_dir(device)
    if mine is None or not device.name:
        return {}, None
    path = crossover_file(device.name, mine)
    return read_safely(lambda: _load(path), str(path)) or {}, path


def device_ranges(key: str, device) -> tuple[tuple[tuple[int, int], ...], str]:
    """(ranges, where they came from) for a layer on a kernels.options.DeviceSpec: the user's own tuned
    crossover (user_tables.py: `vllm-wna16 tune` on this GPU, driver and plugin) when it has the layer,
    else the shipped table."""
    table, path = _user_table(device)
    if key in table:
        return tuple(table[key]["cuda_m_ranges"]), f"your tuned table {path}"
    return cuda_m_ranges(key, device.name), f"crossover/{crossover_file(device.name or '?').name}"


def has_entry(key: str, device) -> bool:
    """Whether a table (the user's or the shipped one) measured this layer on the device, even with no win."""
    return bool(device.name) and (key in _user_table(device)[0] or key in _load(crossover_file(device.name)))


def cuda_max_m(key: str, device_name: str | None, crossover_dir: Path | None = None) -> int:
    """The largest batch up to which `cuda` measured faster from M=1 on; 0 = it does not win at M=1."""
    ranges = cuda_m_ranges(key, device_name, crossover_dir)
    return next((hi for lo, hi in ranges if lo == 1), 0)


def in_ranges(m: int, ranges) -> bool:
    return any(lo <= m <= hi for lo, hi in ranges)


MIN_GAIN = 0.03  # a win is cuda at least 3% faster: below that, medians of two kernels are noise


def measured_ranges(times: dict[int, tuple[float, float]], min_gain: float = MIN_GAIN) -> list[list[int]]:
    """{M: (cuda µs, triton µs)} -> the runs [lo, hi] of consecutive measured M where cuda won
    (took less than (1 - min_gain) of triton's time)."""
    ranges: list[list[int]] = []
    won_last = False
    for m in sorted(times):
        cuda_us, triton_us = times[m]
        won = cuda_us < (1.0 - min_gain) * triton_us
        if won and won_last:
            ranges[-1][1] = m
        elif won:
            ranges.append([m, m])
        won_last = won
    return ranges


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
    """Merge {key: {"cuda_m_ranges": [[lo, hi], ...], "source": ...}} into the device's file; returns its path."""
    from vllm_wna16_plugin.user_tables import logger, write_atomically

    path = crossover_file(device_name, crossover_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        table = dict(_load(path)) if path.is_file() else {}
    except (ValueError, RecursionError) as exc:  # a damaged table is replaced, not a run's results lost
        logger.warning("moe_wna16_plus: replacing the damaged crossover table %s (%s)", path, exc)
        table = {}
    table.update(entries)
    write_atomically(path, json.dumps(dict(sorted(table.items())), indent=2) + "\n")
    _load.cache_clear()
    return path


__all__ = [
    "CROSSOVER_DIR",
    "cuda_m_ranges",
    "device_ranges",
    "has_entry",
    "cuda_max_m",
    "in_ranges",
    "layer_key",
    "measured_crossover",
    "measured_ranges",
    "write_crossovers",
]
