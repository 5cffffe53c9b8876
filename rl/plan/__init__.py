"""The memory planner: bytes per consumer, tier and phase, predicted from the config (`python -m rl.plan`)."""
