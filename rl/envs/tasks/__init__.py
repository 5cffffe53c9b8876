"""Tasks and environments: the Environment protocol and the shipped tasks, registered by name."""
from rl.envs.tasks.base import TASKS, Environment, StepResult, make_task, register_task, resolve_task
from rl.envs.tasks.code_reward import CodeReward
from rl.envs.tasks.digits import MajorityDigit
from rl.envs.tasks.lookup import KeyLookup
from rl.envs.tasks.restate import Restate
from rl.envs.tasks.scored import ScoredTask
from rl.envs.tasks.tool_arith import ToolArith

__all__ = ["TASKS", "Environment", "StepResult", "make_task", "register_task", "resolve_task", "MajorityDigit",
           "KeyLookup", "ScoredTask", "ToolArith", "CodeReward", "Restate"]
