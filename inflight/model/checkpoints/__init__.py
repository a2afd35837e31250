"""Checkpoints: Hugging Face directories and GGUF files, their tokenizers, and the model built
from them."""
