"""Native kernels: C for the CPU (built with gcc on first use), Triton for CUDA."""
