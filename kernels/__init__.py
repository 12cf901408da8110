"""Attention kernels: Triton for CUDA, each beside the pure-torch reference that is the CPU path."""
