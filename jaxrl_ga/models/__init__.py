"""Decoder-only transformers (Qwen2 / Llama families) and their Hugging Face interop."""
