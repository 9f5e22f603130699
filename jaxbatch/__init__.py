"""jaxbatch: a JAX research framework for LLM batching policies."""

__version__ = "0.1.0"
