"""The on-disk cache of dequantized GGUF weights (paged.model.weight_cache), on tiny Q4_1 GGUF files."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from paged.config import ModelConfig
from paged.kernels.toolchain.cache_dir import ENV_VAR
from paged.model import gguf_loader, weight_cache, weights
from paged.model.weight_cache import entry_path, file_sha256, load_gguf_cached
from paged.model.weights import load_weights

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 64, 4, 2, 128, 96
fresh_load = gguf_loader.load_gguf  # the real dequantization, whatever a test patches


def write_gguf(path: Path, seed: int = 0) -> Path:
    """A one-layer Llama: Q4_1 matrices (what SmolLM2's file holds) and fp32 norms."""
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    shapes = {  # torch order, [out, in]
        "token_embd.weight": (VOCAB, HIDDEN),
        "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
        "blk.0.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
        "blk.0.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
        "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
        "blk.0.ffn_gate.weight": (FFN, HIDDEN),
        "blk.0.ffn_up.weight": (FFN, HIDDEN),
        "blk.0.ffn_down.weight": (HIDDEN, FFN),
    }
    for name, shape in shapes.items():
        w = rng.standard_normal(shape).astype(np.float32)
        writer.add_tensor(name, quantize(w, GGMLQuantizationType.Q4_1), raw_dtype=GGMLQuantizationType.Q4_1)
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(ENV_VAR, str(root))
    return root / weight_cache.SUBDIR


@pytest.fixture
def dequantizations(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The paths `load_gguf` dequantized, in order."""
    calls: list[Path] = []
    def spy(path):
        calls.append(Path(path))
        return fresh_load(path)

    monkeypatch.setattr(gguf_loader, "load_gguf", spy)
    monkeypatch.setattr(weights, "load_gguf", spy)
    return calls


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype == torch.float32, name
        assert torch.equal(a[name], b[name]), name


def entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.is_dir() else []


def test_second_load_hits_the_cache_with_bit_identical_tensors(tmp_path, cache, dequantizations):
    gguf = write_gguf(tmp_path / "m.gguf")
    entry = entry_path(file_sha256(gguf))
    arch1, state1, how1 = load_gguf_cached(gguf)
    assert how1 == f"dequantized m.gguf, cached to {entry}"
    arch2, state2, how2 = load_gguf_cached(gguf)
    assert how2 == f"loaded m.gguf from cache {entry}"
    assert dequantizations == [gguf]  # the second load did not dequantize
    fresh_arch, fresh = fresh_load(gguf)
    assert arch1 == arch2 == fresh_arch
    assert (arch2.num_kv_heads, arch2.tie_word_embeddings) == (KV_HEADS, True)
    assert_identical(state1, fresh)
    assert_identical(state2, fresh)
    assert entries(cache) == [entry.name]
    assert entry.name.startswith(file_sha256(gguf))


def test_the_key_is_the_file_content_not_its_path(tmp_path, cache, dequantizations):
    a, b = write_gguf(tmp_path / "a.gguf", seed=0), write_gguf(tmp_path / "b.gguf", seed=1)
    load_gguf_cached(a)
    _, state_b, _ = load_gguf_cached(b)
    assert len(entries(cache)) == 2
    assert_identical(state_b, fresh_load(b)[1])
    # the same content under another name is a hit
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(a.read_bytes())
    assert load_gguf_cached(copy)[2].startswith("loaded copy.gguf from cache")
    # new content at a cached path is a miss, never the old weights
    write_gguf(a, seed=2)
    _, state_a2, how = load_gguf_cached(a)
    assert how.startswith("dequantized a.gguf")
    assert_identical(state_a2, fresh_load(a)[1])
    assert dequantizations == [a, b, a]


def _truncate(entry: Path) -> None:
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])


def _garbage_header(entry: Path) -> None:
    data = bytearray(entry.read_bytes())
    data[8:40] = b"x" * 32
    entry.write_bytes(bytes(data))


def _flip_a_weight_byte(entry: Path) -> None:
    data = bytearray(entry.read_bytes())
    data[-100] ^= 0xFF  # in the tensor data, which only the checksum catches
    entry.write_bytes(bytes(data))


@pytest.mark.parametrize("corrupt", [_truncate, _garbage_header, _flip_a_weight_byte, lambda e: e.write_bytes(b"")])
def test_a_corrupt_entry_is_logged_and_rebuilt(tmp_path, cache, dequantizations, caplog, corrupt):
    gguf = write_gguf(tmp_path / "m.gguf")
    load_gguf_cached(gguf)
    entry = entry_path(file_sha256(gguf))
    corrupt(entry)
    with caplog.at_level(logging.WARNING, logger="paged.model.weight_cache"):
        _, state, how = load_gguf_cached(gguf)
    assert "is unreadable" in caplog.text and "dequantizing again" in caplog.text
    assert how == f"dequantized m.gguf, cached to {entry}"
    assert_identical(state, fresh_load(gguf)[1])
    assert load_gguf_cached(gguf)[2].startswith("loaded m.gguf from cache")  # rebuilt
    assert dequantizations == [gguf, gguf]


def test_an_unwritable_cache_dir_still_loads(tmp_path, monkeypatch, dequantizations, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # a file where the cache root should be: mkdir fails even for root
    monkeypatch.setenv(ENV_VAR, str(blocker / "paged"))
    gguf = write_gguf(tmp_path / "m.gguf")
    with caplog.at_level(logging.WARNING, logger="paged.model.weight_cache"):
        arch, state, how = load_gguf_cached(gguf)
        load_gguf_cached(gguf)
    assert how == "dequantized m.gguf, not cached"
    assert "going on uncached" in caplog.text
    fresh_arch, fresh = fresh_load(gguf)
    assert arch == fresh_arch
    assert_identical(state, fresh)
    assert dequantizations == [gguf, gguf]


def test_a_failed_write_leaves_no_entry_and_no_temporary_file(tmp_path, cache, monkeypatch, dequantizations):
    def save_fails(state, filename, metadata=None):
        Path(filename).write_bytes(b"half an entry")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(weight_cache, "save_file", save_fails)
    gguf = write_gguf(tmp_path / "m.gguf")
    assert load_gguf_cached(gguf)[2] == "dequantized m.gguf, not cached"
    assert entries(cache) == []


def _model(gguf: Path, **kw) -> ModelConfig:
    return ModelConfig(name="m", source="gguf", path=str(gguf), device="cpu", **kw)


def test_weight_cache_false_always_dequantizes(tmp_path, cache, dequantizations, caplog):
    gguf = write_gguf(tmp_path / "m.gguf")
    with caplog.at_level(logging.INFO, logger="paged.model.weights"):
        _, state, _ = load_weights(_model(gguf, weight_cache=False))
        load_weights(_model(gguf, weight_cache=False))
    assert entries(cache) == []
    assert dequantizations == [gguf, gguf]
    assert "weights: dequantized m.gguf (model.weight_cache=false) in " in caplog.text
    # a cached entry is not used either
    load_weights(_model(gguf))
    load_weights(_model(gguf, weight_cache=False))
    assert dequantizations == [gguf, gguf, gguf, gguf]
    assert_identical(state, fresh_load(gguf)[1])


def test_load_weights_logs_where_the_weights_came_from_and_how_long_it_took(tmp_path, cache, caplog):
    gguf = write_gguf(tmp_path / "m.gguf")
    assert ModelConfig(name="m", source="gguf").weight_cache is True
    with caplog.at_level(logging.INFO, logger="paged.model.weights"):
        load_weights(_model(gguf))
        arch, _, tokenizer_source = load_weights(_model(gguf, sliding_window=8))
    lines = [r.getMessage() for r in caplog.records if r.name == "paged.model.weights"]
    entry = entry_path(file_sha256(gguf))
    assert lines[0].startswith(f"weights: dequantized m.gguf, cached to {entry} in ")
    assert lines[1].startswith(f"weights: loaded m.gguf from cache {entry} in ")
    assert lines[1].endswith(" s")
    assert arch.sliding_window == 8 and tokenizer_source == gguf  # the config still applies to a hit


def test_a_changed_loader_misses_and_replaces_the_old_entry(tmp_path, cache, monkeypatch, dequantizations):
    gguf = write_gguf(tmp_path / "m.gguf")
    load_gguf_cached(gguf)
    old = entries(cache)
    monkeypatch.setattr(weight_cache, "FORMAT_VERSION", weight_cache.FORMAT_VERSION + 1)
    weight_cache.loader_tag.cache_clear()
    try:
        _, _, how = load_gguf_cached(gguf)
        assert how.startswith("dequantized m.gguf, cached to")
        assert len(entries(cache)) == 1 and entries(cache) != old  # the old loader's entry is gone
    finally:
        monkeypatch.undo()
        weight_cache.loader_tag.cache_clear()
    assert dequantizations == [gguf, gguf]


def test_file_sha256_matches_hashlib(tmp_path):
    import hashlib

    blob = np.random.default_rng(0).bytes(3 * (1 << 20) + 17)  # crosses the 1 MiB chunks
    (tmp_path / "f").write_bytes(blob)
    assert file_sha256(tmp_path / "f") == hashlib.sha256(blob).hexdigest()
