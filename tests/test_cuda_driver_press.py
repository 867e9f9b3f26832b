"""The KV presses' CUDA launches on the recording fake libcuda.so.1 (`tests/fake_driver/press_scenario.py`):
the attention mass's two launches (log-sum-exp per counted row, then a thread per key) and
copy_slots' gather and scatter per layer, with their grids, blocks and arguments as the driver
receives them. The runner refuses a plan whose argument sizes differ from the cubin's, so a
launch that reached the driver matches the compiled kernel's signature (unverified on a GPU)."""

from __future__ import annotations

import pytest

from tests import fake_driver
from tests.fake_driver.press_scenario import (
    BLOCK,
    HEAD,
    HEADS,
    KV_HEADS,
    LAST,
    NUM_QUERIES,
    SCALE,
    SEQ_LENS,
    SLOT_PAIRS,
    SOFT_CAP,
)
from tests.test_cuda_driver import _case, _check_common_launch, _decode, _f32, _i32, _launched, _ptr

pytestmark = pytest.mark.compiles


@pytest.fixture(scope="module")
def press_run(tmp_path_factory: pytest.TempPathFactory) -> fake_driver.Run:
    driver_dir = fake_driver.build_or_skip(tmp_path_factory.mktemp("fake_driver"))
    return fake_driver.run_scenario("press", tmp_path_factory.mktemp("press"), driver_dir)


def test_attention_mass_launches_a_row_pass_then_a_key_pass(press_run: fake_driver.Run) -> None:
    r, calls = _case(press_run, "mass")
    lse, mass = _launched(calls)
    assert r["mass_shape"] == [len(SEQ_LENS), KV_HEADS, max(SEQ_LENS)]
    _check_common_launch(lse, r["names"][0], (min(LAST, max(NUM_QUERIES)), KV_HEADS, len(SEQ_LENS)), 128, 0,
                         r["stream"])
    _check_common_launch(mass, r["names"][1], (-(-max(SEQ_LENS) // 128), KV_HEADS, len(SEQ_LENS)), 128, 0,
                         r["stream"])
    params = _decode(lse)[1:]
    assert _decode(mass)[3:] == params and _decode(mass)[1] == _decode(lse)[0]
    assert _decode(mass)[0] == _ptr(r["mass"]) and _decode(mass)[2] == _i32(max(SEQ_LENS))
    assert params[0] == _ptr(r["query"]) and params[1] == _ptr(r["key_cache"])
    # heads, KV heads, head size, x (16 fp8 elements), block size, table width, query row stride
    assert params[5:12] == [_i32(HEADS), _i32(KV_HEADS), _i32(HEAD), _i32(16), _i32(BLOCK), _i32(3),
                            _i32(HEADS * HEAD)]
    assert params[14:] == [_i32(_f32(SCALE)), _i32(_f32(SOFT_CAP)), _ptr(r["k_scale"]), _i32(LAST)]


def test_copy_slots_gathers_then_scatters_each_layer(press_run: fake_driver.Run) -> None:
    r, calls = _case(press_run, "slots")
    launched = _launched(calls)
    assert len(launched) == 2 * len(r["caches"])
    for i, launch in enumerate(launched):
        _check_common_launch(launch, r["names"][2], (len(SLOT_PAIRS), 1, 1), KV_HEADS * HEAD, 0, r["stream"])
        args = _decode(launch)
        key_cache, value_cache = r["caches"][i // 2]
        assert args[:2] == [_ptr(key_cache), _ptr(value_cache)] and args[4] == _ptr(r["mapping"])
        assert args[5:] == [_i32(KV_HEADS), _i32(HEAD), _i32(BLOCK), _i32(8), _i32(i % 2)]
