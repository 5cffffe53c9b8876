"""Tasks and environments: the Environment protocol and the shipped tasks, registered by name."""
from rl.tasks.base import TASKS, Environment, StepResult, make_task, register_task
from rl.tasks.digits import MajorityDigit

__all__ = ["TASKS", "Environment", "StepResult", "make_task", "register_task", "MajorityDigit"]
