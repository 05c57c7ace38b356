"""genolong: long-context language modelling of genomes (prepare -> finetune -> eval-positional)."""

__version__ = "0.1.0"
