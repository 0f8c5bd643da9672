"""jaxserve: a JAX/Pallas serving engine for hybrid linear-attention LLMs."""
