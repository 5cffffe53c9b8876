"""The framework face: orchestrator, tasks/environments, rewards, entry points (see README.md)."""
