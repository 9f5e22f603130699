"""`python -m jaxbatch` runs the same Hydra entry point as the `jaxbatch` command."""

from jaxbatch.cli import main

main()
