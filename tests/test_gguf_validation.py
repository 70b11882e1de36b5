"""Files are checked before they are trusted: a GGUF's tensor layout as llama.cpp's loader
checks it, each problem a ValueError naming the file and the tensor or key."""

from __future__ import annotations

import re
import struct

import pytest

from nanokv import gguf as nk_gguf

from .test_gguf import private_gguf_cache, write_synthetic  # noqa: F401 - the fixture is autouse

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed: pip install gguf")
V = gguf.GGUFValueType


# ---- the tensor layout ------------------------------------------------------------------

def _tensor_field(path: str, name: str, part: int) -> int:
    """The byte offset of one part of a tensor's info in the header: 2 n_dims, 3 dims,
    4 type, 5 offset."""
    (t,) = [t for t in gguf.GGUFReader(path).tensors if t.name == name]
    return int(t.field.offset) + sum(p.nbytes for p in t.field.parts[:part])


def _edit(good: str, bad, edits) -> str:
    data = bytearray(open(good, "rb").read())
    for name, part, index, fmt, value in edits:
        struct.pack_into(fmt, data, _tensor_field(good, name, part) + index * struct.calcsize(fmt), value)
    bad.write_bytes(bytes(data))
    return str(bad)


def _tensor_offsets(path: str) -> dict[str, int]:
    """Each tensor's offset within the data section, as its info gives it."""
    reader = gguf.GGUFReader(path)
    return {t.name: int(t.field.parts[5][0]) for t in reader.tensors}


LAYOUTS = {  # (edits: tensor, part, item, struct format, value), the error after the path
    "unaligned": (lambda o: [("f16", 5, 0, "<Q", o["f16"] + 4)],
                  r"tensor f16 starts at offset \d+ of the data section, expected \d+: .* unaligned or overlapping"),
    "overlapping": (lambda o: [("i8", 5, 0, "<Q", o["f16"])],
                    r"tensor i8 starts at offset \d+ of the data section, expected \d+"),
    "out of order": (lambda o: [("f16", 5, 0, "<Q", o["i8"]), ("i8", 5, 0, "<Q", o["f16"])],
                     r"tensor f16 starts at offset \d+ of the data section, expected \d+"),
    "ragged quantized row": (lambda o: [("q8_0", 3, 0, "<Q", 250)],
                             r"tensor q8_0 is Q8_0 with 250 values per row, not a multiple of its block size 32"),
    "zero dim": (lambda o: [("f32", 3, 1, "<Q", 0)], r"tensor f32 has the dimensions \[5, 0, 2\]"),
    "negative dim": (lambda o: [("f32", 3, 2, "<Q", 2**64 - 2)], r"tensor f32 has the dimensions \[5, 3, \d+\]"),
    "product overflows": (lambda o: [("f32", 3, 0, "<Q", 2**40), ("f32", 3, 1, "<Q", 2**40)],
                          r"tensor f32 has the dimensions .* product at most 9223372036854775807"),
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_a_bad_tensor_layout_names_the_file_and_the_tensor(tmp_path, case):
    """As llama.cpp's gguf.cpp: each tensor exactly where the ones before it end (aligned),
    at most 4 dims each >= 1 with an int64 product, rows whole blocks, a known type."""
    good = write_synthetic(tmp_path / "good.gguf")
    edits, problem = LAYOUTS[case]
    bad = _edit(good, tmp_path / "bad.gguf", edits(_tensor_offsets(good)))
    with pytest.raises(ValueError, match=f"^{re.escape(bad)}: {problem}"):
        nk_gguf.read_tensors(bad)


def test_more_than_four_dims_are_refused(tmp_path):
    import numpy as np

    path = str(tmp_path / "5d.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("five", np.zeros((1, 2, 1, 2, 2), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=f"^{re.escape(path)}: tensor five has 5 dimensions; GGUF tensors have at "
                                         "most 4"):
        nk_gguf.read_tensors(path)


def _insert_kv(good: str, bad, key: bytes, value: bytes, pad_key: bool = True) -> str:
    """The file with one more metadata item (its value: type and bytes) before the others,
    its key padded with "_" to make the item a multiple of the alignment (32) long, so the
    data section moves with it and the tensors' offsets hold."""
    data = open(good, "rb").read()
    while pad_key and (8 + len(key) + len(value)) % 32:
        key += b"_"
    item = struct.pack("<Q", len(key)) + key + value
    assert len(item) % 32 == 0, len(item)
    (n_kv,) = struct.unpack_from("<Q", data, 16)
    bad.write_bytes(data[:16] + struct.pack("<Q", n_kv + 1) + item + data[24:])
    return str(bad)


def test_deeply_nested_metadata_arrays_are_refused_without_recursion(tmp_path):
    good = write_synthetic(tmp_path / "good.gguf")
    depth = 10_000  # arrays of arrays: far beyond Python's recursion limit
    value = struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 0, 0)
    bad = _insert_kv(good, tmp_path / "deep.gguf", b"test.deep", value)
    with pytest.raises(ValueError, match=f"^{re.escape(bad)}: metadata key test.deep_* nests arrays more than 8 "
                                         "deep"):
        nk_gguf.read_tensors(bad)
    shallow = _insert_kv(good, tmp_path / "shallow.gguf", b"test.nest",
                         struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 2 + struct.pack("<IQ", 0, 1) + b"\0")
    assert [t.name for t in nk_gguf.read_tensors(shallow)] == [t.name for t in nk_gguf.read_tensors(good)]


def test_a_key_given_twice_is_refused(tmp_path):
    good = write_synthetic(tmp_path / "good.gguf")
    bad = _insert_kv(good, tmp_path / "twice.gguf", b"test.string", struct.pack("<IQ", 8, 1) + b"x", pad_key=False)
    with pytest.raises(ValueError, match=f"^{re.escape(bad)}: metadata key test.string appears twice"):
        nk_gguf.read_tensors(bad)
