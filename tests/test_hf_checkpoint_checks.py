"""model=hf checkpoints checked against their config.json before the weights load (issue 30).

Tiny checkpoints saved by transformers are broken one way each; every break must be a one-line
CheckpointError (a ConfigError: run.py prints `error: ...`, rc 2) naming the file or tensor, the
value found and the one expected.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from paged.config import ConfigError, ModelConfig
from paged.model.arch import LlamaArch
from paged.model.bloom import BloomModel
from paged.model.checkpoint_check import CheckpointError
from paged.model.checkpoint_layout import expected_tensors, ignorable
from paged.model.hf_loader import load_hf, read_hf_arch
from paged.model.llama import LlamaModel
from paged.model.tokenizer import load_hf_tokenizer
from paged.model.weights import load_weights
from tests.test_cli import run_cli

pytestmark = pytest.mark.subprocess

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8)
TINY_BLOOM = dict(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)


def save(model: PreTrainedModel, path: Path, **kwargs) -> Path:
    model.save_pretrained(path, **kwargs)
    return path


def llama(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(llama(), tmp_path_factory.mktemp("llama"))


@pytest.fixture
def ckpt(saved: Path, tmp_path: Path) -> Path:
    """A fresh copy of the good tiny Llama checkpoint, to break."""
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


def edit_config(path: Path, **changes) -> Path:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return path


def edit_weights(path: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    state = load_file(path / "model.safetensors")
    change(state)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


def refused(path: Path, *needles: str) -> str:
    """The one-line CheckpointError loading `path` raises, checked to contain each needle."""
    with pytest.raises(CheckpointError) as err:
        load_hf(path)
    message = str(err.value)
    assert "\n" not in message and isinstance(err.value, ConfigError)
    for needle in needles:
        assert needle in message, message
    return message


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_good_checkpoint_loads_tied_or_not(tmp_path: Path, tied: bool) -> None:
    arch, state = load_hf(save(llama(tie_word_embeddings=tied), tmp_path))
    assert (arch.num_layers, arch.tie_word_embeddings) == (2, tied)
    assert ("lm_head.weight" in state) is not tied
    LlamaModel(arch, state)


def test_config_with_fewer_layers_than_the_weights_is_refused(ckpt: Path) -> None:
    # before: the decoder ran the first layer only, silently
    refused(edit_config(ckpt, num_hidden_layers=1), f"checkpoint {ckpt}:", "num_hidden_layers=1",
            "layers 0..1", "(model.layers.1.*)")


def test_config_with_more_layers_than_the_weights_is_refused(ckpt: Path) -> None:
    # before: KeyError('model.layers.2.input_layernorm.weight')
    refused(edit_config(ckpt, num_hidden_layers=4), "num_hidden_layers=4", "layers 0..1 only",
            "no model.layers.2.*, model.layers.3.*")


def test_shape_implied_by_the_config_is_checked(ckpt: Path) -> None:
    refused(edit_config(ckpt, intermediate_size=64), "model.layers.0.mlp.gate_proj.weight in model.safetensors",
            "shape [48, 32] but config.json implies [64, 32] (intermediate_size x hidden_size)",
            "; 5 more tensors mismatch too")


def test_kv_heads_are_checked_against_the_projections(ckpt: Path) -> None:
    refused(edit_config(ckpt, num_key_value_heads=4), "k_proj.weight", "[16, 32]", "[32, 32]",
            "num_key_value_heads*head_dim x hidden_size")


def test_missing_tensor_is_named(ckpt: Path) -> None:
    edit_weights(ckpt, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    refused(ckpt, "missing tensors model.layers.1.mlp.up_proj.weight")


def test_untied_config_without_an_lm_head_is_refused(tmp_path: Path) -> None:
    path = edit_config(save(llama(tie_word_embeddings=True), tmp_path), tie_word_embeddings=False)
    refused(path, "missing tensors lm_head.weight", "tie_word_embeddings=false")


def test_tensor_the_decoder_would_ignore_is_refused_but_recomputed_buffers_pass(ckpt: Path) -> None:
    def add(state: dict[str, torch.Tensor]) -> None:
        state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # older Llama saves: harmless
        state["model.layers.0.self_attn.o_proj.bias"] = torch.ones(32)  # Llama's attention_bias: not harmless

    refused(edit_weights(ckpt, add), "does not read: model.layers.0.self_attn.o_proj.bias;")
    edit_weights(ckpt, lambda s: s.pop("model.layers.0.self_attn.o_proj.bias"))
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" in load_hf(ckpt)[1]


def test_integer_weights_are_refused(ckpt: Path) -> None:
    def quantize(state: dict[str, torch.Tensor]) -> None:
        state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"].to(torch.int8)

    refused(edit_weights(ckpt, quantize), "model.embed_tokens.weight (I8): not a floating-point dtype")


def test_quantized_config_is_refused(ckpt: Path) -> None:
    refused(edit_config(ckpt, quantization_config={"quant_method": "gptq"}), "quant_method='gptq'")


def test_truncated_safetensors_is_named(ckpt: Path) -> None:
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    refused(ckpt, f"{weights} is not a readable safetensors file (truncated or corrupt?)")


def test_invalid_config_json_is_named(ckpt: Path) -> None:
    (ckpt / "config.json").write_text('{"model_type": "llama",')
    refused(ckpt, f"{ckpt / 'config.json'} is not valid JSON")


@pytest.mark.parametrize(
    ("change", "needle"),
    [({"hidden_size": None}, "lacks 'hidden_size', which a llama config needs"),
     ({"num_hidden_layers": "2"}, "num_hidden_layers='2' must be a positive integer"),
     ({"model_type": "gpt2"}, "model_type='gpt2' is not supported"),
     ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope scaling 'yarn' is not implemented")],
    ids=["missing-key", "string-value", "model-type", "rope-scaling"],
)
def test_bad_config_value_is_named(ckpt: Path, change: dict, needle: str) -> None:
    edit_config(ckpt, **change)
    refused(ckpt, needle)
    with pytest.raises(CheckpointError, match=needle.split("'")[0]):
        read_hf_arch(ckpt)  # the spec-only path (executor=sim) reads the config the same way


def test_directory_without_config_is_a_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf(tmp_path)


def test_pytorch_bin_only_checkpoint_names_what_is_read(ckpt: Path) -> None:
    (ckpt / "model.safetensors").rename(ckpt / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"pytorch_model.bin: only safetensors weights are read"):
        load_hf(ckpt)


def test_sharded_checkpoint_loads_and_a_missing_shard_is_named(tmp_path: Path) -> None:
    path = save(llama(), tmp_path, max_shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert len(load_hf(path)[1]) == len(index["weight_map"])
    (path / shards[-1]).unlink()
    refused(path, "model.safetensors.index.json lists shards missing", shards[-1])


def hf_config(path: Path) -> ModelConfig:
    return ModelConfig(name="hf", source="hf", path=str(path))


def test_missing_tokenizer_is_named_before_the_weights_load(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # before: transformers' "You need to have sentencepiece or tiktoken installed" (it is installed)
    monkeypatch.setattr("paged.model.weights.read_weights", lambda shards: pytest.fail("weights read"))
    with pytest.raises(CheckpointError, match=rf"^no tokenizer in {ckpt} \(tokenizer.json / tokenizer.model"):
        load_weights(hf_config(ckpt))
    with pytest.raises(CheckpointError, match="^no tokenizer in"):
        load_hf_tokenizer(str(ckpt))


@pytest.mark.parametrize(("file", "content"), [("tokenizer.model", b"not a sentencepiece model"),
                                               ("tokenizer.json", b'{"version": "1.0"}')])
def test_unreadable_tokenizer_is_one_line(ckpt: Path, file: str, content: bytes) -> None:
    (ckpt / file).write_bytes(content)
    with pytest.raises(CheckpointError, match=f"^the tokenizer in {ckpt} could not be loaded: ") as err:
        load_hf_tokenizer(str(ckpt))
    assert "\n" not in str(err.value)


def test_run_py_prints_the_mismatch_as_one_error_line(ckpt: Path, tmp_path: Path) -> None:
    edit_config(ckpt, num_hidden_layers=1)
    proc = run_cli(tmp_path / "out", "model=hf", f"model.path={ckpt}", "logger=none", "progress=false")
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: ") and f"checkpoint {ckpt}: config.json says num_hidden_layers=1" in line


def bloom(**overrides) -> BloomForCausalLM:
    torch.manual_seed(0)
    return BloomForCausalLM(BloomConfig(**{**TINY_BLOOM, **overrides})).eval()


@pytest.mark.parametrize("prefixed", [True, False], ids=["save_pretrained", "bigscience"])
def test_bloom_layouts_load_and_their_layers_are_checked(tmp_path: Path, prefixed: bool) -> None:
    path = save(bloom(), tmp_path)
    prefix = "transformer." if prefixed else ""
    if not prefixed:  # bigscience's own checkpoints name the decoder's tensors without a prefix
        edit_weights(path, lambda s: s.update({k.removeprefix("transformer."): s.pop(k) for k in list(s)}))
    arch, state = load_hf(path)
    assert arch.architecture == "bloom" and f"{prefix}h.1.mlp.dense_4h_to_h.bias" in state
    BloomModel(arch, state)
    refused(edit_config(path, n_layer=1), "n_layer=1 but the weights hold layers 0..1", f"({prefix}h.1.*)")
    refused(edit_config(path, n_layer=2, n_embed=64), f"{prefix}word_embeddings.weight",
            "[64, 32] but config.json implies [64, 64] (vocab_size x hidden_size)")


def test_qwen2_qkv_biases_are_expected(tmp_path: Path) -> None:
    torch.manual_seed(0)
    path = save(Qwen2ForCausalLM(Qwen2Config(**TINY)), tmp_path)
    assert load_hf(path)[0].qkv_bias
    edit_weights(path, lambda s: s.pop("model.layers.0.self_attn.k_proj.bias"))
    refused(path, "missing tensors model.layers.0.self_attn.k_proj.bias")


# The expected-tensor table against transformers' own modules (names and shapes) and against what
# our decoders read, for every architecture model=hf loads.
REFERENCES = {
    "llama": lambda: llama(),
    "llama-tied": lambda: llama(tie_word_embeddings=True),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**TINY)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**TINY)),
    "bloom": lambda: bloom(tie_word_embeddings=False),
    "bloom-tied": lambda: bloom(),
}


class Recording(dict):
    """A state dict remembering which names a decoder reads."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__(state)
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        self.read.add(name)
        return super().__getitem__(name)


@pytest.mark.parametrize("name", list(REFERENCES))
def test_expected_tensors_are_what_transformers_holds_and_our_decoder_reads(name: str) -> None:
    model = REFERENCES[name]()
    arch = LlamaArch.from_hf_config(model.config.to_dict())
    hf_state = {k: v for k, v in model.state_dict().items() if not ignorable(arch, k)}
    expected = expected_tensors(arch, hf_state)
    assert {k: tuple(v.shape) for k, v in hf_state.items()} == {k: e.shape for k, e in expected.items()}
    state = Recording(hf_state)
    (BloomModel if arch.architecture == "bloom" else LlamaModel)(arch, state)
    assert state.read == set(expected)
