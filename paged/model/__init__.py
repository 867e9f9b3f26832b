"""Llama-family model, its loaders (GGUF, HF safetensors, tiny random), tokenizer and sampler.

Kept import-free so `import paged.model.sampler` does not pull in transformers.
"""
