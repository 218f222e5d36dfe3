"""KernelOptions (vllm_wna16_plugin/kernels/options.py): every field checked by type and value at construction."""

from __future__ import annotations

import math

import pytest

from vllm_wna16_plugin.kernels.options import KernelOptions


@pytest.mark.parametrize(
    "kwargs, message",
    [
        # strings a user might mean as False were accepted and read as True
        (dict(own_align="no"), r"own_align='no' must be True or False"),
        (dict(cuda_stream="off"), r"cuda_stream='off' must be True or False"),
        (dict(programmatic_launch=0), r"programmatic_launch=0 must be True or False"),
        # a string or None reached a comparison (TypeError) or read as the value it spells
        (dict(cuda_ctas_per_sm="4"), r"cuda_ctas_per_sm='4' must be an int, not str"),
        (dict(cuda_min_warp_steps=None), r"cuda_min_warp_steps=None must be an int, not NoneType"),
        (dict(cuda_max_block_m="8"), r"cuda_max_block_m='8' must be an int, not str"),
        (dict(cuda_max_block_m=True), r"cuda_max_block_m=True must be an int, not bool"),
        (dict(cuda_max_block_m=3), r"cuda_max_block_m=3 must be one of 1, 2, 4, 8, 16"),
        (dict(cuda_stream_min_pairs_per_warp=math.nan), r"cuda_stream_min_pairs_per_warp=nan must be a number >= 0"),
        (dict(cuda_stream_min_pairs_per_warp="6"), r"cuda_stream_min_pairs_per_warp='6' must be a number >= 0"),
        (dict(cuda_ctas_per_sm=0), r"cuda_ctas_per_sm=0 must be >= 1"),
    ],
)
def test_bad_kernel_options_are_named_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KernelOptions(**kwargs)


def test_the_defaults_and_plain_values_construct():
    KernelOptions()
    KernelOptions(own_align=False, cuda_stream=False, cuda_ctas_per_sm=2, cuda_min_warp_steps=0,
                  cuda_max_block_m=16, cuda_stream_min_pairs_per_warp=4)  # fmt: skip
