"""The public API, vLLM's offline one: `LLM` (`llm`), its options and inputs (`options`, `inputs`) and what
it returns (`outputs`: `RequestOutput`, and the summary and request files a run writes)."""
