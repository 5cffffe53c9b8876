"""Tools for agentic environments: sandboxed code execution (sandbox.py) and tool-call parsing with a
tool registry (calls.py)."""
