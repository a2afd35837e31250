"""CUDA C kernels, built with nvcc on first use (where Triton falls short)."""
