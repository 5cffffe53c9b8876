"""Tasks and environments: the Environment protocol and the shipped tasks, registered by name."""
from rl.tasks.base import TASKS, Environment, StepResult, make_task, register_task, resolve_task
from rl.tasks.code_reward import CodeReward
from rl.tasks.digits import MajorityDigit
from rl.tasks.lookup import KeyLookup
from rl.tasks.scored import ScoredTask
from rl.tasks.tool_arith import ToolArith

__all__ = ["TASKS", "Environment", "StepResult", "make_task", "register_task", "resolve_task", "MajorityDigit",
           "KeyLookup", "ScoredTask", "ToolArith", "CodeReward"]
