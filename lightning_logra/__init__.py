"""lightning-logra: RLVR on language models with full-parameter updates from low-rank gradient sketches."""

__version__ = "0.1.0"
