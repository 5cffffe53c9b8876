"""What the policy is trained on: tasks (environments), tools, data rows."""
