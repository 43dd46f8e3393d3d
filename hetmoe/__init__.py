"""hetmoe: run giant Mixture-of-Experts language models on one GPU plus CPU DRAM."""

__version__ = "0.1.0"
