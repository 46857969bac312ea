"""A small gloo job for torchrun that trains until it is told to stop: all-reduces with a short
sleep between them, until rank 0 sees the file given by --stop-file. Rank 0's decision travels
in the all-reduce itself, so every rank stops after the same step, and all exit cleanly."""

import argparse
import os
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--stop-file", required=True)
parser.add_argument("--step-s", type=float, default=0.05)
args = parser.parse_args()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.zeros(9)
steps = 0
while True:
    t[:8] = 1.0
    t[8] = 1.0 if rank == 0 and os.path.exists(args.stop_file) else 0.0
    dist.all_reduce(t)
    steps += 1
    if t[8] > 0:
        break
    time.sleep(args.step_s)
dist.barrier()
dist.destroy_process_group()
print(f"rank {rank}/{world} done after {steps} steps", flush=True)
