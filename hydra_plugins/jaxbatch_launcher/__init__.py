"""jaxbatch's Hydra launcher `vmap` (`hydra/launcher=vmap`): see `vmap_launcher`."""
