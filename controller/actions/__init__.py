"""What `tracehound watch` does about an incident of a job it did not launch: the action port
(`port`) and its adapters, observe (`observe`, the default), a user's command (`command`,
`--on-incident`) and Slurm (`slurm`, `--slurm`, through `scontrol`: drain, requeue, cancel)."""
