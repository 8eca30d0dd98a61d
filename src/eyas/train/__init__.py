"""Training the drafter: data sources (offline store / online target), loop, checkpoints, evaluation."""
