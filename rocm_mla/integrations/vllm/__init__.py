"""vLLM general plugin and MLA backend."""
