"""The Lightning wiring: the module, the training modes, checkpoints and the strategies."""
