"""End to end on SmolLM2-135M: greedy tokens with the whole step's kernels emulated from the CUDA
sources (prefill attention, decode v2 over several partitions, the cache write, the fused layer
ops) equal those of the torch backend. One run: the emulator takes about 90 s for it, and decode
v1 on the emulator runs end to end in the executor's tests (tests/test_executor_swap.py,
tests/test_step_plan.py) on smaller models."""

from __future__ import annotations

import pytest

from paged.config import KernelConfig, ModelConfig
from paged.executor.model_executor import ModelExecutor
from paged.kernels.toolchain import emulator, host_compiler, specs
from paged.model.locate import INSTALL_HINT, locate_smollm2
from tests.test_executor import generate

pytestmark = [pytest.mark.compiles, pytest.mark.slow]

PROMPT = "What is the capital of France?"
MAX_NEW = 4
# Small enough that the chat-formatted prompt plus output spans two partitions.
PARTITION = 32


@pytest.fixture(scope="module", autouse=True)
def _requirements() -> None:
    try:
        locate_smollm2()
    except FileNotFoundError:
        pytest.skip(f"SmolLM2 weights not installed ({INSTALL_HINT})")
    try:
        host_compiler.find_compiler()
    except host_compiler.CompilerNotFoundError as e:
        pytest.skip(f"emu backend unavailable: {e}")


def _greedy(backend: str, version: str) -> tuple[list[int], list[int]]:
    ex = ModelExecutor(
        ModelConfig(name="smollm2-135m", source="gguf", chat_template=True, device="cpu"),
        KernelConfig(name="e2e", version=version, backend=backend, partition_size=PARTITION),
    )
    ex.init_kv_cache(num_blocks=16, block_size=16)
    prompt = ex.tokenizer.encode(PROMPT)
    if backend == "emu":
        dtype = ex.key_caches[0].dtype
        emulator.prepare([specs.cache_unit(dtype), specs.layer_unit(dtype),
                          specs.prefill_unit(dtype, ex.arch.head_dim, 16),
                          specs.attention_unit(dtype, ex.arch.head_dim, 16, version, PARTITION)])
    return prompt, generate(ex, [prompt], MAX_NEW)[0]


@pytest.fixture(scope="module")
def reference() -> list[int]:
    return _greedy("torch", "v1")[1]


def test_emulated_kernels_generate_the_torch_tokens(reference: list[int]) -> None:
    prompt, tokens = _greedy("emu", "v2")
    assert len(reference) == MAX_NEW
    assert len(prompt) + MAX_NEW > PARTITION, "the test must cross a partition boundary"
    assert tokens == reference
