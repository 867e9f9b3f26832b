"""vLLM habits on the LLM API (issue 30): `LLM(model)` from a config name, an HF directory or a GGUF
file; vLLM's engine keyword arguments mapped to config keys (an unknown one refused by name);
`max_tokens=None`; `LLM.chat` and `LLM.get_tokenizer`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from paged import LLM, SamplingParams
from paged.api.options import EngineArgs, llm_config
from paged.config import ConfigError, compose_config
from paged.experiment.run import run_experiment
from paged.model.locate import locate_smollm2

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def config_for(model: str = "tiny-random", allocator: str | None = None, overrides=(), **kwargs):
    return llm_config(model, allocator=allocator, overrides=overrides, engine_args=EngineArgs.from_kwargs(kwargs))


@pytest.mark.parametrize(
    ("kwargs", "key", "value"),
    [
        ({"max_model_len": 512}, "scheduler.max_model_len", 512),
        ({"gpu_memory_utilization": 0.5}, "allocator.gpu_memory_utilization", 0.5),
        ({"dtype": "half"}, "model.dtype", "float16"),
        ({"dtype": "float"}, "model.dtype", "float32"),
        ({"dtype": torch.bfloat16}, "model.dtype", "bfloat16"),
        ({"dtype": "auto"}, "model.dtype", "auto"),
        ({}, "model.dtype", "float32"),  # not given: the model config's own
        ({"seed": 7}, "seed", 7),
        ({"max_num_seqs": 8}, "scheduler.max_num_seqs", 8),
        ({"max_num_batched_tokens": 1024}, "scheduler.max_num_batched_tokens", 1024),
        ({"block_size": 32}, "allocator.block_size", 32),
        ({"swap_space": 2}, "allocator.swap_space", "2GiB"),
        ({"swap_space": 0.5}, "allocator.swap_space", "0.5GiB"),
        ({"enable_prefix_caching": False}, "allocator.name", "naive"),
        ({"enable_prefix_caching": True}, "allocator.name", "prefix"),
        ({}, "allocator.name", "prefix"),
        ({"enable_chunked_prefill": False}, "scheduler.chunked_prefill", False),
        ({"kv_cache_dtype": "fp8"}, "kernel.kv_cache_dtype", "fp8_e4m3"),
        ({"kv_cache_dtype": "fp8_e5m2"}, "kernel.kv_cache_dtype", "fp8_e5m2"),
        ({"enforce_eager": True}, "executor.cuda_graphs", False),
        ({"tensor_parallel_size": 2}, "executor.tensor_parallel_size", 2),
        # accepted, changing nothing
        ({"tensor_parallel_size": 1, "trust_remote_code": True, "tokenizer": "tiny-random"}, "model.name",
         "tiny-random"),
    ],
)
def test_vllm_keyword_argument_sets_its_config_key(kwargs, key, value) -> None:
    assert OmegaConf.select(config_for(**kwargs), key) == value


def test_tensor_parallel_size_is_the_simulated_gpu_count() -> None:
    cfg = config_for("llama-3-8b", overrides=["executor=sim"], tensor_parallel_size=4, enforce_eager=True)
    assert cfg.hardware.num_gpus == 4 and "cuda_graphs" not in cfg.executor


def test_llm_keeps_its_own_options_and_builds_with_vllm_arguments() -> None:
    llm = LLM("tiny-random", allocator="naive", max_model_len=64, max_num_seqs=4, seed=3, overrides=["seed=5"])
    assert (llm.config.allocator.name, llm.config.scheduler.max_model_len, llm.engine.scheduler.max_num_seqs) == (
        "naive", 64, 4)
    assert llm.config.seed == 5  # overrides come last
    assert len(llm.generate("Hello", GREEDY)[0].token_ids) == 4


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_modle_len": 5}, TypeError, "LLM() got an unexpected keyword argument 'max_modle_len'; did you mean "
         "'max_model_len'? (accepted: allocator, block_size"),
        ({"quantization": "awq"}, TypeError, "unexpected keyword argument 'quantization' (accepted: allocator,"),
        ({"tensor_parallel_size": 3}, ConfigError, "executor.tensor_parallel_size=3 does not divide tiny-random's"),
        ({"pipeline_parallel_size": 2}, ConfigError, "pipeline_parallel_size=2 is not supported"),
        ({"dtype": "float64"}, ConfigError, "dtype='float64' is not supported; allowed: auto, float, half, float32"),
        ({"dtype": torch.float64}, ConfigError, "dtype='float64' is not supported"),
        ({"kv_cache_dtype": "int8"}, ConfigError, "kv_cache_dtype='int8' is not supported; allowed: auto, fp8,"),
        ({"tokenizer": "gpt2"}, ConfigError, "tokenizer='gpt2': a separate tokenizer is not supported"),
        ({"max_model_len": "2048"}, ConfigError, "max_model_len must be an integer, got '2048'"),
        ({"max_model_len": 0}, ConfigError, "scheduler.max_model_len=0 must be > 0"),
        ({"gpu_memory_utilization": 1.5}, ConfigError, "allocator.gpu_memory_utilization=1.5 must be in (0, 1]"),
        ({"block_size": 7}, ConfigError, "allocator.block_size=7 is not supported"),
        ({"swap_space": -1}, ConfigError, "swap_space must be a non-negative number, got -1"),
        ({"swap_space": 0, "overrides": ["scheduler.preemption_mode=swap"]}, ConfigError,
         "swap_space=0 leaves no CPU swap pool, but scheduler.preemption_mode=swap swaps"),
        ({"enable_prefix_caching": "yes"}, ConfigError, "enable_prefix_caching must be True or False, got 'yes'"),
        ({"enable_prefix_caching": True, "allocator": "naive"}, ConfigError,
         "enable_prefix_caching=True contradicts allocator='naive'"),
        ({"enforce_eager": 1}, ConfigError, "enforce_eager must be True or False, got 1"),
    ],
)
def test_bad_engine_argument_is_refused_in_one_line(kwargs, error, message) -> None:
    with pytest.raises(error, match=re.escape(message)) as info:
        LLM("tiny-random", **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("tiny-randm", "model='tiny-randm' is not a config model name, a local Hugging Face checkpoint directory "
         "(with config.json) or a .gguf file; did you mean 'tiny-random'? config names: gemma-2-27b, "
         "gemma-3-27b, hf, "),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "(a hub id is not downloaded)"),
        ("/no/such/model.gguf", "model='/no/such/model.gguf' is not a config model name"),
        (".", "model='.' is a directory without config.json: not a Hugging Face checkpoint"),
        (3, "model must be a config model name or a path, got int 3"),
    ],
)
def test_unknown_model_is_refused_with_the_accepted_forms(model, message) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        LLM(model)
    assert "\n" not in str(info.value)


def test_a_gguf_path_selects_the_gguf_loader_even_with_spaces_and_quotes(tmp_path: Path) -> None:
    folder = tmp_path / "my models, it's here"
    folder.mkdir()
    link = folder / "SmolLM2 copy.gguf"
    link.symlink_to(locate_smollm2())
    cfg = config_for(str(link))
    assert (cfg.model.source, cfg.model.path, cfg.model.name) == ("gguf", str(link.resolve()), "SmolLM2 copy")


@pytest.mark.slow
def test_llm_on_a_gguf_path_equals_the_config_model() -> None:
    by_path = LLM(str(locate_smollm2())).generate("The capital of France is", GREEDY)[0].token_ids
    assert by_path == LLM("smollm2-135m").generate("The capital of France is", GREEDY)[0].token_ids


def test_llm_on_an_hf_directory_runs_it_and_checks_ids_against_its_vocabulary(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from paged.model.tokenizer import load_hf_tokenizer

    torch.manual_seed(1)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3,
    )).eval()
    hf.save_pretrained(tmp_path)
    load_hf_tokenizer(str(locate_smollm2())).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), max_model_len=256)
    assert (llm.config.model.source, llm.config.model.path) == ("hf", str(tmp_path.resolve()))
    prompt = [11, 22, 33, 44, 55]
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=4, eos_token_id=None)
    assert llm.generate([prompt], GREEDY)[0].token_ids == ref[0, len(prompt):].tolist()
    # the tokenizer knows 49152 tokens, the model embeds 1000: the model's count bounds the ids
    with pytest.raises(ValueError, match=re.escape("token id 1000 at position 1 is outside the vocabulary [0, 1000)")):
        llm.generate([[5, 1000]], GREEDY)


@pytest.fixture(scope="module")
def short() -> LLM:
    """tiny-random with a 48-token context: max_tokens=None runs to it quickly."""
    return LLM("tiny-random", max_model_len=48)


def test_max_tokens_none_generates_up_to_the_context(short: LLM) -> None:
    params = SamplingParams(max_tokens=None, ignore_eos=True, temperature=0.0)
    a, b = short.generate(["Hello", "The capital of France is"], params)
    for out in (a, b):
        assert len(out.prompt_token_ids) + len(out.token_ids) == 48
        assert out.outputs[0].finish_reason == "length"
    assert params.max_tokens is None  # each request resolved its own copy


def test_max_tokens_none_without_room_is_aborted_with_the_reason(short: LLM) -> None:
    full, fine = short.generate(
        [list(range(1, 49)), "Hello"], SamplingParams(max_tokens=None, min_tokens=2, ignore_eos=True, temperature=0.0)
    )
    assert full.abort_reason == (
        "max_tokens=None: the prompt's 48 tokens leave 0 of max_model_len=48 to generate, fewer than 2"
    )
    assert fine.abort_reason is None and fine.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
     ({"max_tokens": 2, "min_tokens": 3}, "min_tokens must be <= max_tokens=2, got 3")],
)
def test_max_tokens_checks_still_hold(kwargs, message) -> None:
    assert SamplingParams(max_tokens=None, min_tokens=3).max_tokens is None
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)


def test_a_prompt_file_line_with_null_max_tokens_runs_to_the_context(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "Hello", "max_tokens": None, "ignore_eos": True}) + "\n")
    cfg = compose_config(["model=tiny-random", "logger=none", "progress=false", "workload=prompts",
                          f"workload.path={path}", "scheduler.max_model_len=40"])
    run_experiment(cfg, tmp_path / "run")
    (line,) = [json.loads(s) for s in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    assert len(line["output_token_ids"]) == 40 - line["prompt_len"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random")


def test_chat_renders_the_template_and_generates_from_it(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    (out,) = llm.chat(CHAT, GREEDY)
    assert out.prompt == text and text.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert out.token_ids == llm.generate({"prompt_token_ids": out.prompt_token_ids}, GREEDY)[0].token_ids


def test_chat_takes_a_list_of_conversations_a_template_and_no_generation_prompt(llm: LLM) -> None:
    second = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    outs = llm.chat([CHAT, second], GREEDY, add_generation_prompt=False)
    assert len(outs) == 2 and not outs[0].prompt.endswith("<|im_start|>assistant\n")
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (out,) = llm.chat(second, GREEDY, chat_template=template)
    assert out.prompt == "[user] Hi\n[assistant] Hello!\n"


@pytest.mark.parametrize(
    ("messages", "error", "message"),
    [
        ("Hi", TypeError, "messages must be a conversation (a list of messages) or a list of conversations"),
        ([], TypeError, "got list []"),
        ([[]], ValueError, "conversation 0 is empty"),
        ([{"role": "user"}], ValueError, "conversation 0, message 0 has no 'content' (keys ['role'])"),
        ([{"content": "Hi"}], ValueError, "conversation 0, message 0 has no 'role'"),
        ([{"role": "user", "content": 5}], TypeError, "conversation 0, message 0: content must be a str, got int 5"),
        ([CHAT, ["Hi"]], TypeError, "conversation 1, message 0 is str 'Hi'"),
    ],
)
def test_bad_messages_fail_the_chat_call(llm: LLM, messages, error, message) -> None:
    submitted = len(llm.engine.metrics.requests)
    with pytest.raises(error, match=re.escape(message)):
        llm.chat(messages, GREEDY)
    assert len(llm.engine.metrics.requests) == submitted


def test_chat_without_a_chat_template_says_so(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llm.get_tokenizer(), "chat_template", None)
    with pytest.raises(ValueError, match="has no chat template: pass chat_template="):
        llm.chat(CHAT, GREEDY)


def test_get_tokenizer_is_the_models_hf_tokenizer(llm: LLM) -> None:
    assert llm.get_tokenizer().encode("Hello") == llm.executor.tokenizer.encode("Hello")


def test_a_model_without_a_tokenizer_says_so() -> None:
    llm = LLM("llama-3-8b", overrides=["executor=sim"])
    with pytest.raises(ValueError, match=r"^the model has no tokenizer \(llama-3-8b"):
        llm.get_tokenizer()
    with pytest.raises(ValueError, match="prompt 0 is text, but the model has no tokenizer"):
        llm.generate("Hello", GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[llm.executor.vocab_size]], GREEDY)
