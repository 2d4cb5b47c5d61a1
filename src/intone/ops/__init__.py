"""Kernels (Triton on CUDA, with torch equivalents elsewhere): the ground floor, importing nothing of intone."""
