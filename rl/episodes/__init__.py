"""Episodes through the engine: the rollout driver, the episode runner, environment calls, validation."""
