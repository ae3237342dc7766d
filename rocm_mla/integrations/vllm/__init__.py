"""vLLM integration: a general plugin (``plugin.register``) and an MLA backend (``backend``).

Nothing here imports vLLM at package import time: vLLM loads ``plugin.register`` through the
``vllm.general_plugins`` entry point, and the registry imports ``backend`` only when vLLM
resolves the backend class.
"""
