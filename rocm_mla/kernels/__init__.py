"""Triton kernels, installed as ``rocm_mla.kernels`` (never a top-level ``kernels`` module)."""
