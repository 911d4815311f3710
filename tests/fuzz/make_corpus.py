#!/usr/bin/env python3
"""Writes the seed corpus of the safetensors fuzzer (corpus/safetensors/): well-formed files that
exercise every dtype, rank and the metadata, and hostile ones that break each rule of the format
(each also has its own test in tests/io/safetensors.test.cpp). Files the fuzzer finds that crash
the reader are added to the same folder by hand, so they run as regression tests forever.
usage: make_corpus.py [OUT_DIR]"""
import json
import os
import struct
import sys


def image(header, data=b"", raw_header=None, pad=True):
    text = raw_header if raw_header is not None else json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + data


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def nested(levels, kind):
    """JSON nested `levels` deep, of arrays or of objects: past the reader's limit of 64 levels."""
    if kind == "arrays":
        return b"[" * levels + b"]" * levels
    return b'{"a":' * levels + b"1" + b"}" * levels


DEEP = 2000  # far past the limit, still a small seed (objects, 6 bytes a level, a third as deep)
f32 = struct.pack("<6f", 1, 2, 3, 4, 5, 6)
seeds = {
    "valid_f32": image({"w": entry("F32", [2, 3], 0, 24)}, f32),
    "valid_all_dtypes": image({"__metadata__": {"format": "pt"}, "a": entry("F32", [2], 0, 8),
                               "b": entry("F64", [1], 8, 16), "c": entry("I64", [1, 1], 16, 24),
                               "d": entry("BOOL", [3], 24, 27)},
                              struct.pack("<2f", 1.5, -2) + struct.pack("<d", 3.25) + struct.pack("<q", -7) + b"\x01\x00\x01"),
    "valid_empty_and_scalar": image({"e": entry("F32", [0, 4], 0, 0), "s": entry("F32", [], 0, 4)}, struct.pack("<f", 9)),
    "valid_rank4": image({"t": entry("F32", [1, 1, 2, 1], 0, 8)}, struct.pack("<2f", 0.5, 0.25)),
    "overflowing_shape": image({"x": entry("F32", [4611686018427387905, 4], 0, 16)}, bytes(16)),
    "float_size": image({"x": entry("F32", [1e300], 0, 4)}, bytes(4)),
    "fractional_size": image({"x": entry("F32", [-1.5], 0, 4)}, bytes(4)),
    "negative_size": image({"x": entry("F32", [-1], 0, 4)}, bytes(4)),
    "overlapping": image({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, bytes(12)),
    "hole": image({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}, bytes(12)),
    "trailing_bytes": image({"a": entry("F32", [1], 0, 4)}, bytes(8)),
    "duplicate_name": image(None, bytes(8), raw_header=b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                                                     b'"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}'),
    "header_too_large": struct.pack("<Q", 1 << 40) + b"{}",
    "truncated": image({"w": entry("F32", [2, 3], 0, 24)}, f32)[:-5],
    "offsets_reversed": image({"a": entry("F32", [1], 4, 0)}, bytes(4)),
    "unknown_dtype": image({"a": entry("F16", [2], 0, 4)}, bytes(4)),
    # bfloat16 1.5, -2, +inf, a quiet NaN and the smallest subnormal, then the same shape with one byte short.
    "valid_bf16": image({"h": entry("BF16", [5], 0, 10)}, struct.pack("<5H", 0x3FC0, 0xC000, 0x7F80, 0x7FC0, 0x0001)),
    "bf16_size_mismatch": image({"h": entry("BF16", [5], 0, 9)}, bytes(9)),
    "extra_key": image({"a": dict(entry("F32", [1], 0, 4), extra=1)}, bytes(4)),
    "not_an_object": image(None, b"", raw_header=b"[1,2,3]"),
    "metadata_not_strings": image({"__metadata__": {"n": 3}}),
    "deep_arrays_entry": image(None, bytes(4), raw_header=b'{"x":' + nested(DEEP, "arrays") + b"}"),
    "deep_objects_shape": image(None, bytes(4), raw_header=b'{"x":{"dtype":"F32","shape":' + nested(DEEP // 3, "objects") +
                                b',"data_offsets":[0,4]}}'),
    "deep_arrays_metadata": image(None, bytes(4), raw_header=b'{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                                  b'"__metadata__":{"m":' + nested(DEEP, "arrays") + b"}}"),
    "deep_objects_header": image(None, b"", raw_header=nested(DEEP // 3, "objects")),
}

out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "safetensors")
os.makedirs(out, exist_ok=True)
for name, data in seeds.items():
    with open(os.path.join(out, name + ".safetensors"), "wb") as f:
        f.write(data)
print(f"wrote {len(seeds)} files to {out}")
