"""Developer tools that are not part of the package: the prepared GPU check (gpu_check.sh, whose
Python sections are gpu_check.py and the check_*.py modules beside it; docs/gpu_check.md)."""
