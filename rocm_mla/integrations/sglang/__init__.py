"""SGLang integration: a general plugin (``plugin.register``) and an MLA attention backend
(``backend``).

Nothing here imports SGLang at package import time: SGLang runs ``plugin.register`` through
the ``sglang.srt.plugins`` entry point, and the registered factories import ``backend`` only
when a model runner builds its attention backend.
"""
