"""scheme: WNA16Scheme validates itself, -1 is channel-wise, None normalizes to -1."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_wna16_plugin.scheme import CHANNELWISE, SUPPORTED_BITS, PackFormat, WNA16Scheme, normalize_group_size


def _make(**kw):
    args = dict(bits=4, group_size=128, has_zero_point=False, pack_format=PackFormat.GPTQ)
    args.update(kw)
    return WNA16Scheme(**args)


@pytest.mark.parametrize("bits", [1, 2, 3, 5, 16])
def test_unsupported_bits_raise(bits):
    with pytest.raises(ValueError, match=rf"bits={bits} is not supported; supported: \[4, 8\]"):
        _make(bits=bits)


@pytest.mark.parametrize("group_size", [0, -2, -128])
def test_non_positive_group_size_other_than_channelwise_raises(group_size):
    with pytest.raises(ValueError, match=rf"group_size={group_size} is not supported.*-1 \(channel-wise\)"):
        _make(group_size=group_size)


@pytest.mark.parametrize("offset", [-1, 2])
def test_zero_point_offset_must_be_0_or_1(offset):
    with pytest.raises(ValueError, match=rf"zero_point_offset must be 0 or 1, got {offset}"):
        _make(zero_point_offset=offset)


def test_valid_schemes_build():
    for bits in SUPPORTED_BITS:
        for gs in (32, 64, 128, CHANNELWISE):
            s = _make(bits=bits, group_size=gs)
            assert s.bits == bits and s.group_size == gs


def test_scheme_is_frozen_and_hashable():
    s = _make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.bits = 8  # type: ignore[misc]
    assert {s: 1}[_make()] == 1


@pytest.mark.parametrize("value, expected", [(None, -1), (-1, -1), (32, 32), (128, 128)])
def test_channelwise_none_group_size_means_minus_one(value, expected):
    assert normalize_group_size(value) == expected


@pytest.mark.parametrize(
    "group_size, size_k, groups, group_len",
    [
        (32, 2048, 64, 32),  # Qwen3.5-35B-A3B hidden
        (128, 768, 6, 128),  # Qwen3-30B-A3B intermediate
        (32, 1344, 42, 32),
        (CHANNELWISE, 704, 1, 704),  # gemma channel-wise: one group spans K
        (CHANNELWISE, 96, 1, 96),
    ],
)
def test_num_groups_and_group_size_for(group_size, size_k, groups, group_len):
    s = _make(group_size=group_size)
    assert s.num_groups(size_k) == groups
    assert s.group_size_for(size_k) == group_len
    assert s.is_channelwise == (group_size == CHANNELWISE)


@pytest.mark.parametrize("bits, pack_factor, midpoint", [(4, 8, 8), (8, 4, 128)])
def test_pack_factor_and_symmetric_zero(bits, pack_factor, midpoint):
    s = _make(bits=bits)
    assert s.pack_factor == pack_factor
    assert s.symmetric_zero == midpoint


@pytest.mark.parametrize(
    "kw, text",
    [
        (dict(source="gptq"), "gptq int4 group 128 symmetric"),
        (dict(source="gptq", desc_act=True), "gptq int4 group 128 symmetric, act-order"),
        (
            dict(bits=8, group_size=CHANNELWISE, has_zero_point=True, source="compressed-tensors"),
            "compressed-tensors int8 channel-wise asymmetric",
        ),
        (dict(pack_format=PackFormat.AWQ, has_zero_point=True, group_size=64), "awq int4 group 64 asymmetric"),
    ],
)
def test_describe(kw, text):
    assert _make(**kw).describe() == text


def test_pack_format_values_name_the_checkpoint_format():
    assert [f.value for f in PackFormat] == ["gptq", "awq", "compressed-tensors"]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("bits", "4", r"bits='4' is a string, not an int; supported: an int"),
        ("bits", True, r"bits=True is a bool, not an int"),
        ("group_size", 128.0, r"group_size=128\.0 is a float, not an int"),
        ("group_size", [128], r"group_size=\[128\] is a list, not an int"),
        ("zero_point_offset", None, r"zero_point_offset=None is null, not an int"),
        ("has_zero_point", 1, r"has_zero_point=1 is an int, not a bool; supported: True, False"),
        ("desc_act", "false", r"desc_act='false' is a string, not a bool"),
        ("pack_format", "gptq", r"pack_format='gptq' is not a PackFormat; supported: PackFormat\.GPTQ"),
    ],
)
def test_wrong_field_type_names_the_type(field, value, message):
    kwargs = {"bits": 4, "group_size": 128, "has_zero_point": False, "pack_format": PackFormat.GPTQ}
    with pytest.raises(ValueError, match=message):
        WNA16Scheme(**{**kwargs, field: value})


@pytest.mark.parametrize("value, kind", [("128", "a string"), (True, "a bool"), (64.0, "a float")])
def test_normalize_group_size_refuses_non_ints(value, kind):
    with pytest.raises(ValueError, match=rf"group_size={value!r} is {kind}, not an int"):
        normalize_group_size(value)
