"""Speech models: the parts of text-to-speech models (Qwen3-TTS) that are numerics only."""
