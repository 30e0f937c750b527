"""Execution phase: sandboxes, worker processes, the scheduler that runs missing actions and stores their results."""
