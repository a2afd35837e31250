"""Triton kernels for CUDA devices (imported only there)."""
