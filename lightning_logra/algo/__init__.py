"""The RL math on top of the sketches: losses, advantages, log-probs, the predicted KL, updates and step sizes."""
