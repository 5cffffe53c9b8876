import sys

from rl.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
