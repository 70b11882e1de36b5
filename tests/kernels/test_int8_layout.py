"""quantization="int8": the weight layout (int8 dot products or int8 weights widened into
float32 FMAs) measured once per kernel library and kept in the cache, or the one
NANOKV_INT8_LAYOUT names. The measurement is faked where the choice is checked: which
layout is faster is the machine's business, not a test's."""

from __future__ import annotations

import json

import pytest
import torch

from nanokv import kernels
from nanokv.kernels import ops
from nanokv.kernels.ffi import lib

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler: CPU kernels not built")

# int8 costs 2 * 1 = 2, int8w 1 * 3 = 3: int8 is the faster in all
FAKE = {"int8": {"1": 2.0, "32": 1.0}, "int8w": {"1": 1.0, "32": 3.0}}


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """The layout file in tmp_path, the measurement counted and faked; nothing remembered
    in the process between calls."""
    lib()  # the library itself stays where it was built
    calls = []
    monkeypatch.delenv(ops.INT8_LAYOUT_ENV, raising=False)
    monkeypatch.setattr(ops.build, "cache_dir", lambda: tmp_path / "kernels")
    monkeypatch.setattr(ops, "time_int8_layouts", lambda: calls.append(1) or FAKE)
    ops._measured_layout.cache_clear()
    yield calls, tmp_path / "kernels" / f"{lib().nk_name}.int8-layout.json"
    ops._measured_layout.cache_clear()


def again():
    ops._measured_layout.cache_clear()  # a new process
    return ops.int8_format()


def test_measured_once_then_read_from_the_cache(measured):
    calls, path = measured
    assert ops.int8_format() == "int8" and len(calls) == 1
    entry = json.loads(path.read_text())
    assert entry == {"library": lib().nk_name, "layout": "int8", "seconds": FAKE}
    assert again() == "int8" and len(calls) == 1  # read back, not measured
    path.write_text(json.dumps(dict(entry, layout="int8w")))
    assert again() == "int8w" and len(calls) == 1  # the kept choice is the one used


@pytest.mark.parametrize("damage", [b"", b"{not json", b"[1, 2]", b'{"library": "nanokv_cpu_other", "layout": "int8"}',
                                    b'{"layout": "float32"}'])
def test_a_damaged_or_foreign_entry_is_measured_again(measured, damage):
    calls, path = measured
    path.parent.mkdir(parents=True)
    path.write_bytes(damage)
    assert ops.int8_format() == "int8" and len(calls) == 1
    assert json.loads(path.read_text())["layout"] == "int8"  # replaced by a whole entry


def test_a_cache_that_cannot_be_written_only_costs_the_measurement(measured, monkeypatch, tmp_path):
    calls, _ = measured
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setattr(ops.build, "cache_dir", lambda: blocked / "kernels")  # under a file: no folder there
    assert ops.int8_format() == "int8" and again() == "int8" and len(calls) == 2


def test_the_environment_names_the_layout(measured, monkeypatch):
    calls, _ = measured
    for layout in ops.INT8_FORMATS:
        monkeypatch.setenv(ops.INT8_LAYOUT_ENV, layout)
        assert ops.int8_format() == layout
    monkeypatch.setenv(ops.INT8_LAYOUT_ENV, "int4")
    with pytest.raises(ValueError, match="NANOKV_INT8_LAYOUT='int4'.*int8 or int8w"):
        ops.int8_format()
    assert not calls


def test_timing_covers_both_layouts_and_restores_the_thread_count():
    threads = torch.get_num_threads()
    seconds = ops.time_int8_layouts()
    assert set(seconds) == set(ops.INT8_FORMATS)
    for times in seconds.values():
        assert set(times) == {str(r) for r in ops.LAYOUT_ROWS} and min(times.values()) > 0
    assert torch.get_num_threads() == threads
