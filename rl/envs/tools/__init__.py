"""Tools for agentic environments: sandboxed code execution (sandbox.py: the warm pool; bwrap.py: the OS
boundary, bubblewrap; sandbox_worker.py: the script each sandboxed interpreter runs) and tool-call parsing
with a tool registry (calls.py)."""
