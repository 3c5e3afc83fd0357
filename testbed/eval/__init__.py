"""Time to accuracy: held-out evaluation, quality targets and the learning-rate schedule."""
