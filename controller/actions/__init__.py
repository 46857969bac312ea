"""What the watcher does to a job and its nodes in the systems that run them (Slurm: `scontrol`)."""
