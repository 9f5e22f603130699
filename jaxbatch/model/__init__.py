"""The model: dimensions, the Flax transformer, attention and KV cache layouts (no scheduling)."""
