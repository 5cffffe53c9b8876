"""The run: its parts built, the loop and its phases, checkpoints, ranks, tracking, the warm-up, the update."""
