"""A small gloo job for torchrun: all-reduces on the world and on a sub-group, then, once every
rank is done, exits with the status given by --exit-code on rank 1 (0: every rank exits
cleanly)."""

import argparse
import sys

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--exit-code", type=int, default=0)
args = parser.parse_args()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
pair = dist.new_group([0, 1])
t = torch.ones(8)
for _ in range(args.steps):
    dist.all_reduce(t)
    if rank < 2:
        dist.all_reduce(t, group=pair)
dist.barrier()
dist.destroy_process_group()
print(f"rank {rank}/{world} done", flush=True)
if args.exit_code and rank == 1:
    sys.exit(args.exit_code)
