"""Decoder-only transformers (the families of ``families.py``: Qwen2/3, Llama, Gemma 3,
Mistral) and their Hugging Face and GGUF interop."""
