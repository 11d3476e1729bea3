"""Flows and the command line: compose the stage tasks, nothing else."""
