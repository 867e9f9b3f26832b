"""`model=llama-3-8b-random`: Llama-3-8B's shape (`model=llama-3-8b`'s arch) with random weights, drawn
on a GPU in the model's dtype; on a CPU random weights stay drawn in fp32 on the host, so `tiny-random`
is the same model everywhere it ran before."""

from __future__ import annotations

import torch

from paged.config import compose_config
from paged.engine.builder import check_config
from paged.model.tiny import random_state, tiny_arch
from paged.model.weights import load_arch, load_weights


def test_it_is_llama_3_8bs_shape_with_random_weights() -> None:
    cfg = compose_config(["model=llama-3-8b-random"])
    spec = compose_config(["model=llama-3-8b"]).model
    assert (cfg.model.source, cfg.model.dtype) == ("random", "bfloat16")
    assert {k: cfg.model.arch[k] for k in spec.arch} == dict(spec.arch)
    arch, tokenizer = load_arch(cfg.model)
    shape = (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim)
    assert shape == (32, 4096, 32, 8, 128)
    assert (arch.vocab_size, arch.rope_theta, arch.tie_word_embeddings) == (128256, 500000.0, False)
    assert tokenizer.name == "smollm2"
    check_config(cfg)  # the real executor takes it; the simulator too
    check_config(compose_config(["model=llama-3-8b-random", "executor=sim"]))


def test_random_weights_are_drawn_in_the_asked_dtype_and_the_host_path_is_unchanged() -> None:
    for arch in (tiny_arch(), tiny_arch({"architecture": "bloom"})):
        drawn = random_state(arch, seed=0, device="cpu", dtype=torch.bfloat16)
        assert {t.dtype for t in drawn.values()} == {torch.bfloat16}
        assert drawn.keys() == random_state(arch).keys()
    arch = tiny_arch()
    cfg = compose_config(["model=tiny-random"]).model
    _, host, _ = load_weights(cfg, torch.device("cpu"), torch.bfloat16)
    reference = random_state(arch, seed=0)
    assert all(torch.equal(host[k], reference[k]) for k in reference)  # fp32, as before
