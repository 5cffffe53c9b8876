"""`python -m rl.mismatch ...`: rl/mismatch/cli.py."""
import sys

from rl.mismatch.cli import main

sys.exit(main())
