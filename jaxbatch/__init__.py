"""jaxbatch: a JAX research framework for LLM batching policies."""

import logging

__version__ = "0.1.0"

# orbax (checkpoints) logs every save and restore through absl at INFO: keep the console for ours.
logging.getLogger("absl").setLevel(logging.WARNING)
