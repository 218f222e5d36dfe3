"""bench/read_floor.py's read kernels (CPU, Triton interpreter): they read every word they are timed on."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 on CPU")


@pytest.fixture()
def floor(monkeypatch):
    bench = Path(__file__).resolve().parents[1] / "bench"
    monkeypatch.syspath_prepend(str(bench))  # read_floor imports bench_moe as a sibling
    spec = importlib.util.spec_from_file_location("read_floor", bench / "read_floor.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "read_floor", module)
    spec.loader.exec_module(module)
    return module


def test_streaming_read_sums_every_word(floor):
    words = torch.randint(-1000, 1000, (5000,), dtype=torch.int32)  # not a multiple of the block
    out = torch.zeros(3, dtype=torch.int32)
    floor.read(words, out, block=256)
    assert int(out.sum()) == int(words.sum())


@pytest.mark.parametrize("r, c", [(32, 32), (8, 128), (4, 256)])
def test_tile_read_covers_every_row_and_column_tile(floor, r, c):
    rows, pitch = 64, 512  # 64 rows of 2 KB, as the gate/up pattern at small scale
    words = torch.randint(-1000, 1000, (rows * pitch,), dtype=torch.int32)
    out = torch.zeros(5, dtype=torch.int32)  # 5 programs: ranges of uneven length
    floor.tile_read(words, out, rows, pitch, r, c)
    assert int(out.sum()) == int(words.sum())
