"""The inference engine (see README.md): requests in; tokens, logprobs and policy versions out."""
from rollout.engine import ContextTooLong, Engine, EngineConfig

__all__ = ["ContextTooLong", "Engine", "EngineConfig"]
