"""The model's building blocks; each picks its kernel once, at construction."""
