"""`python -m rl.export ...`: rl/export/cli.py."""
import sys

from rl.export.cli import main

sys.exit(main())
