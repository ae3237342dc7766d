"""Paged caches, the runner (single producer of step metadata), workers and the LLM front end.

One decode step under pp x tp x dcp, end to end: docs/architecture.md.
"""

from rocm_mla.distributed import WorkerError
from rocm_mla.engine.cache import CacheFullError
from rocm_mla.engine.llm import LLM

__all__ = ["LLM", "CacheFullError", "WorkerError"]
