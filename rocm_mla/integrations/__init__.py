"""Adapters that put rocm_mla under other frameworks."""
