"""Paged caches, the runner (single producer of step metadata), workers and the LLM front end."""
