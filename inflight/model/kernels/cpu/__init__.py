"""CPU kernels in C, shipped as package data and built with gcc on first use (`native.py`)."""
