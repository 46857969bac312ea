"""A gloo training-job stand-in for the recorder coverage tests: one scenario per collective path.

Launched once per rank with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) and the
recorder auto-installed (the tests put tracehound's bootstrap on PYTHONPATH). It knows nothing of
Tracehound (but for ddp_untraced, which asks for a model left untraced): it runs the
torch.distributed calls of its scenario and prints what the tests compare
the records with, as `fact <json>` lines.

    python coverage_job.py SCENARIO    (ddp, ddp_hooks, ddp_untraced, ddp_counted, fsdp2,
                                        pipeline, subgroups, alltoall, objects, async,
                                        inflight, functional, untraced)
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def fact(**values: Any) -> None:
    print("fact " + json.dumps(values), flush=True)


def ddp(rank: int, world: int) -> None:
    """Three steps; each checks that the gradients DDP left (through the recorder's process group)
    are the mean of every rank's gradients, computed here without DDP."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    reference = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    model = DistributedDataParallel(net, bucket_cap_mb=0.0001)  # a bucket per parameter
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(3):
        inputs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + r))
                  for r in range(world)]
        opt.zero_grad()
        model(inputs[rank]).sum().backward()
        reference.load_state_dict(net.state_dict())
        reference.zero_grad()
        for x in inputs:
            (reference(x).sum() / world).backward()
        averaged = all(
            p.grad is not None and q.grad is not None
            and torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)
            for p, q in zip(net.parameters(), reference.parameters(), strict=True)
        )
        fact(kind="ddp_step", step=step, averaged=averaged)
        opt.step()


def ddp_hooks(rank: int, world: int) -> None:
    """Two models, two steps each: one with torch's Python allreduce_hook (its dist.all_reduce
    is what gets recorded, once per bucket), one with DDP's built-in C++ fp16 hook (its
    all-reduce goes through the reducer's process group). Then each all-gathers its gradients
    to compare them across ranks. Prints how often the Python hook ran."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    python_hooked = DistributedDataParallel(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)),
                                            bucket_cap_mb=0.0001)
    calls = [0]

    # (no annotations: DDP checks a hook's against its own types)
    def counted(state, bucket):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    python_hooked.register_comm_hook(None, counted)
    builtin = DistributedDataParallel(nn.Sequential(nn.Linear(16, 4)), bucket_cap_mb=0.0001)
    builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    for name, model in (("python", python_hooked), ("builtin", builtin)):
        for _ in range(2):
            model(torch.randn(8, 16)).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        gathered = [[torch.zeros_like(g) for g in grads] for _ in range(world)]
        for i, g in enumerate(grads):
            dist.all_gather([other[i] for other in gathered], g)
        same = all(torch.allclose(g, other[i], atol=1e-3)
                   for other in gathered for i, g in enumerate(grads))
        fact(kind="ddp_hook", model=name, params=len(grads), hook_calls=calls[0],
             same_grads=same)


def ddp_untraced(rank: int, world: int) -> None:
    """A model built inside hooks.untraced_ddp() keeps DDP's own all-reduce: nothing recorded
    for its buckets; one all_reduce of the program's own is, after it."""
    from torch.nn.parallel import DistributedDataParallel

    from tracehound.agent.rank import hooks

    with hooks.untraced_ddp():
        model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
    dist.all_reduce(torch.ones(1))
    fact(kind="ddp_stats", hooked=hooks.ddp_stats.hooked, skipped=hooks.ddp_stats.skipped)


def ddp_counted(rank: int, world: int) -> None:
    """Run with TRACEHOUND_DDP_TRACE_EVERY=4 (steps 0, 4, 8 recorded): ten steps of a model with
    buffers (BatchNorm: DDP broadcasts them at each forward), the program's own calls on DDP's
    group in step 5 (an all_reduce, an object collective, and uneven point-to-point: rank 0
    sends to every other rank), and in step 6 the last rank busy outside collectives for 2 s
    before its forward, while the others wait in that step's buckets."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64),
                        nn.ReLU(), nn.Linear(64, 1))
    model = DistributedDataParallel(net, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(10):
        if step == 6 and rank == world - 1:
            fact(kind="busy", start_us=time.time_ns() // 1000)
            time.sleep(2.0)
            fact(kind="busy_end", end_us=time.time_ns() // 1000)
        opt.zero_grad()
        model(torch.randn(8, 64)).square().mean().backward()
        if step == 5:
            dist.all_reduce(torch.ones(2))
            names: list[Any] = [None] * world
            dist.all_gather_object(names, f"rank{rank}")
            if rank == 0:
                for peer in range(1, world):
                    dist.send(torch.ones(2), peer)
            else:
                dist.recv(torch.ones(2), 0)
        opt.step()
    time.sleep(0.3)  # a heartbeat after the last step


def ddp_paced(rank: int, world: int) -> None:
    """Run counted only (TRACEHOUND_DDP_TRACE_EVERY=0) with the default span: 300 fast steps of
    a small model, then 12 slow ones (80 ms outside collectives on every rank)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 32)
    for step in range(312):
        if step >= 300:
            time.sleep(0.08)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    time.sleep(0.3)  # a heartbeat after the last step


def fsdp2(rank: int, world: int) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 16)).sum().backward()
        opt.step()


def _batch(ops: list[dist.P2POp]) -> None:
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def pipeline(rank: int, world: int) -> None:
    """A 1F1B pipeline over `world` stages, Megatron-style: every exchange is one
    batch_isend_irecv, sends listed before receives on both ends (so the two ends of a pair list
    their transfers in opposite directions first). The stages are the ranks of a pipeline group
    in reverse order (stage s is global rank world-1-s), the peers given as group ranks through
    P2POp's group_peer, so the records must carry the global ranks they map to."""
    pp = dist.new_group(list(reversed(range(world))), sort_ranks=False)
    stage = dist.get_rank(pp)
    fact(kind="stage", stage=stage, ranks=dist.get_process_group_ranks(pp))
    prev, nxt = stage - 1, stage + 1
    act, grad = 6, 3  # floats per activation and per gradient
    micro = 3
    warmup = min(world - stage - 1, micro)

    def recv_forward() -> None:
        if prev >= 0:
            _batch([dist.P2POp(dist.irecv, torch.empty(act), group=pp, group_peer=prev)])

    def send_forward() -> None:
        if nxt < world:
            _batch([dist.P2POp(dist.isend, torch.ones(act), group=pp, group_peer=nxt)])

    def send_forward_recv_backward() -> None:
        if nxt < world:
            _batch([dist.P2POp(dist.isend, torch.ones(act), group=pp, group_peer=nxt),
                    dist.P2POp(dist.irecv, torch.empty(grad), group=pp, group_peer=nxt)])

    def send_backward_recv_forward() -> None:
        if prev >= 0:
            _batch([dist.P2POp(dist.isend, torch.ones(grad), group=pp, group_peer=prev),
                    dist.P2POp(dist.irecv, torch.empty(act), group=pp, group_peer=prev)])

    def send_backward() -> None:
        if prev >= 0:
            _batch([dist.P2POp(dist.isend, torch.ones(grad), group=pp, group_peer=prev)])

    def recv_backward() -> None:
        if nxt < world:
            _batch([dist.P2POp(dist.irecv, torch.empty(grad), group=pp, group_peer=nxt)])

    for _ in range(warmup):
        recv_forward()
        send_forward()
    if micro > warmup:
        recv_forward()
    for i in range(micro - warmup):
        send_forward_recv_backward()
        if i == micro - warmup - 1:
            send_backward()
        else:
            send_backward_recv_forward()
    for _ in range(warmup):
        recv_backward()
        send_backward()
    # a ring exchange: every rank lists its send first
    ring = [dist.P2POp(dist.isend, torch.ones(2), (rank + 1) % world),
            dist.P2POp(dist.irecv, torch.empty(2), (rank - 1) % world)]
    _batch(ring)
    dist.barrier()


def subgroups(rank: int, world: int) -> None:
    """Groups of every kind: new_group (two groups of two out of four), new_subgroups,
    new_subgroups_by_enumeration and a 2x2 DeviceMesh; a collective on each, and a send inside
    a sub-group addressed by group rank."""
    from torch.distributed.device_mesh import init_device_mesh

    low = dist.new_group([0, 1])
    high = dist.new_group([2, 3])
    mine = low if rank < 2 else high
    unused = dist.new_group([1, 2])  # never used: announced at creation all the same
    if rank in (1, 2):
        fact(kind="unused", name=unused.group_name, ranks=dist.get_process_group_ranks(unused))
    fact(kind="new_group", name=mine.group_name, ranks=dist.get_process_group_ranks(mine))
    dist.all_reduce(torch.ones(4), group=mine)
    dist.broadcast(torch.ones(2), group=mine, group_src=0)
    pairs, _ = dist.new_subgroups(group_size=2)
    fact(kind="new_subgroups", name=pairs.group_name, ranks=dist.get_process_group_ranks(pairs))
    dist.all_reduce(torch.ones(3), group=pairs)
    odd_even, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    fact(kind="by_enumeration", name=odd_even.group_name,
         ranks=dist.get_process_group_ranks(odd_even))
    dist.all_gather(
        [torch.empty(2) for _ in range(2)], torch.ones(2), group=odd_even
    )
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):
        group = mesh.get_group(dim)
        fact(kind=f"mesh_{dim}", name=group.group_name,
             ranks=dist.get_process_group_ranks(group))
        dist.all_reduce(torch.ones(5), group=group)
    # point-to-point inside a sub-group, the peer given as a group rank
    if rank in (2, 3):
        peer = 1 - dist.get_rank(high)
        if rank == 2:
            dist.send(torch.ones(7), group=high, group_dst=peer)
        else:
            dist.recv(torch.empty(7), group=high, group_src=peer)
    dist.barrier()


def alltoall(rank: int, world: int) -> None:
    """all_to_all_single whose members send different amounts, and all_to_all."""
    width = 3  # floats per row
    send_rows = [rank + peer + 1 for peer in range(world)]  # rank r sends 3r + 6 rows
    recv_rows = [peer + rank + 1 for peer in range(world)]
    inp = torch.full((sum(send_rows), width), float(rank))
    out = torch.empty(sum(recv_rows), width)
    dist.all_to_all_single(out, inp, output_split_sizes=recv_rows, input_split_sizes=send_rows)
    fact(kind="all_to_all_single", nbytes=sum(send_rows) * width * 4)
    # equal splits, no split sizes
    even_in = torch.full((world * 2,), float(rank))
    dist.all_to_all_single(torch.empty(world * 2), even_in)
    fact(kind="all_to_all_single_even", nbytes=world * 2 * 4)
    # gloo's list all_to_all takes tensors of one size only
    inputs = [torch.full((2,), float(rank), dtype=torch.float64) for _ in range(world)]
    outputs = [torch.empty(2, dtype=torch.float64) for _ in range(world)]
    dist.all_to_all(outputs, inputs)
    fact(kind="all_to_all", nbytes=world * 2 * 8)
    dist.barrier()


def objects(rank: int, world: int) -> None:
    """Every object collective, between tensor collectives whose ids must stay aligned."""
    dist.all_reduce(torch.ones(1))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "pad": "x" * rank * 100})
    dist.all_reduce(torch.ones(1))
    dist.gather_object({"rank": rank}, [None] * world if rank == 0 else None, dst=0)
    listed: list[Any] = [{"from": 0}, [1, 2, 3]] if rank == 0 else [None, None]
    dist.broadcast_object_list(listed, src=0)
    out: list[Any] = [None]
    dist.scatter_object_list(out, [f"to-{r}" for r in range(world)] if rank == 1 else None,
                             src=1)
    if rank == 0:
        dist.send_object_list([{"a": 1}, "b"], dst=1)
    elif rank == 1:
        objs: list[Any] = [None, None]
        dist.recv_object_list(objs, src=0)
    dist.all_reduce(torch.ones(1))
    fact(kind="objects", gathered=[g["rank"] for g in gathered], listed=listed, out=out[0])


def async_ops(rank: int, world: int) -> None:
    """Every collective with async_op=True, waited afterwards. Rank 1 enters the first one late,
    so its completion on rank 0 is only known from the work's future."""
    if rank == 1:
        time.sleep(0.5)
        fact(kind="late_enter_us", t=time.time_ns() // 1000)
    works = [dist.all_reduce(torch.ones(4), async_op=True)]
    fact(kind="issued_us", t=time.time_ns() // 1000)
    works.append(dist.broadcast(torch.ones(4), src=0, async_op=True))
    works.append(dist.all_gather([torch.empty(2) for _ in range(world)], torch.ones(2),
                                 async_op=True))
    works.append(dist.all_gather_into_tensor(torch.empty(2 * world), torch.ones(2),
                                             async_op=True))
    works.append(dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * world),
                                            async_op=True))
    works.append(dist.all_to_all_single(torch.empty(world), torch.ones(world), async_op=True))
    works.append(dist.reduce(torch.ones(3), dst=0, async_op=True))
    works.append(dist.barrier(async_op=True))
    for work in works:
        work.wait()
    future = dist.all_reduce_coalesced([torch.ones(2), torch.ones(3)], async_op=True)
    future.wait()
    # outside a batch, the two ends of a pair issue their transfers in the same order
    peer = 1 - rank
    send, recv = torch.ones(5), torch.empty(5)
    if rank == 0:
        p2p = [dist.isend(send, peer), dist.irecv(recv, peer)]
    else:
        p2p = [dist.irecv(recv, peer), dist.isend(send, peer)]
    for work in p2p:
        work.wait()
    dist.barrier()


def inflight(rank: int, world: int) -> None:
    """Rank 0 waits about 3 s in an all_reduce that rank 1 enters late; then both idle 3 s with
    nothing pending."""
    dist.barrier()
    if rank == 1:
        time.sleep(3.0)
    fact(kind="enter_us", t=time.time_ns() // 1000)
    dist.all_reduce(torch.ones(1))
    fact(kind="left_us", t=time.time_ns() // 1000)
    time.sleep(3.0)
    fact(kind="idle_end_us", t=time.time_ns() // 1000)
    dist.barrier()


def functional(rank: int, world: int) -> None:
    """Functional collectives (`torch.distributed._functional_collectives`, what DTensor and
    tensor parallelism issue) between `torch.distributed` ones of the same groups: five funcol
    all_reduces and five dist.all_reduces on the default group, then on each dimension of a 2x2
    DeviceMesh (given as `(mesh, dim)`) every kind of funcol call: all_gather, reduce_scatter,
    uneven all_to_all_single, broadcast, a coalesced all_reduce, and one result freed without
    a wait. Then a DTensor sharded on the mesh made whole (`full_tensor`: an all_gather through
    funcol) and its norm (an all_reduce of DTensor's partial placement)."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    world_group = dist.group.WORLD
    total = torch.zeros(4)
    for i in range(5):
        total += funcol.all_reduce(torch.full((4,), float(rank + i)), "sum", world_group)
        dist.all_reduce(torch.ones(4))
    fact(kind="sums", total=total.tolist())
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for dim, label in enumerate(("dp", "tp")):
        group = mesh.get_group(label)
        fact(kind=f"mesh_{label}", name=group.group_name)
        x = torch.full((4,), float(rank))
        gathered = funcol.all_gather_single(x, 0, (mesh, dim))
        scattered = funcol.reduce_scatter_single(torch.ones(4), "sum", 0, (mesh, dim))
        me = dist.get_rank(group)
        splits = [me + 1, 2 - me]  # uneven: member 0 sends 1 then 2 rows, member 1 2 then 1
        received = [me + 1, 2 - me][::-1] if me == 1 else [1, 2]
        swapped = funcol.all_to_all_single(torch.ones(3, 2), received, splits, (mesh, dim))
        sent = funcol.broadcast(torch.full((3,), float(rank)), 0, (mesh, dim))
        pair = funcol.all_reduce_coalesced([torch.ones(2), torch.ones(3)], "sum", (mesh, dim))
        unwaited = funcol.all_reduce(torch.ones(6), "sum", (mesh, dim))
        del unwaited  # freed without a wait: the work ran all the same
        fact(kind=f"results_{label}", gathered=gathered.tolist(),
             scattered=scattered.tolist(), swapped=list(swapped.shape),
             sent=sent.tolist(), pair=[t.sum().item() for t in pair])
        dist.all_reduce(torch.ones(1), group=group)
    whole = distribute_tensor(torch.arange(8.0), mesh["tp"], [Shard(0)])
    fact(kind="full", value=whole.full_tensor().tolist(),
         norm=float(torch.linalg.vector_norm(whole).full_tensor()))
    dist.barrier()


def untraced(rank: int, world: int) -> None:
    """Collectives no wrapper sees, each waited in for about 3 s by rank 0 while rank 1 is busy:
    an all_reduce through a process group's own method, then one inside a torch.compile'd
    function (the graph calls funcol's C++ ops itself). Rank 0's heartbeats must show each as
    pending in the group's backend progress (`<group>:c10d`).

    The function is compiled with the `aot_eager` backend: its graph calls funcol's C++ ops
    (`_c10d_functional.all_reduce`, `wait_tensor`) past every Python wrapper, as inductor's
    generated code does (with the in-place `all_reduce_`); inductor would add only its C++
    compile of `x * 2 + 1`, most of this scenario's 49 s on two shared cores."""
    import torch.distributed._functional_collectives as funcol

    side = dist.new_group(list(range(world)))
    fact(kind="side", name=side.group_name)
    dist.barrier()
    if rank == 1:
        time.sleep(3.0)
    fact(kind="method_enter_us", t=time.time_ns() // 1000)
    side.allreduce([torch.ones(4)]).wait()
    fact(kind="method_left_us", t=time.time_ns() // 1000)

    @torch.compile(backend="aot_eager")
    def twice_summed(x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(x * 2, "sum", side) + 1

    fact(kind="compiled_first", value=twice_summed(torch.ones(4)).tolist())
    dist.barrier()
    if rank == 1:
        time.sleep(3.0)
    fact(kind="compiled_enter_us", t=time.time_ns() // 1000)
    fact(kind="compiled", value=twice_summed(torch.ones(4)).tolist())
    fact(kind="compiled_left_us", t=time.time_ns() // 1000)
    dist.barrier()


SCENARIOS = {
    "ddp": ddp, "ddp_hooks": ddp_hooks, "ddp_untraced": ddp_untraced,
    "ddp_counted": ddp_counted, "ddp_paced": ddp_paced, "fsdp2": fsdp2,
    "pipeline": pipeline, "subgroups": subgroups, "alltoall": alltoall, "objects": objects,
    "async": async_ops, "inflight": inflight, "functional": functional,
    "untraced": untraced,
}


def main() -> int:
    scenario = SCENARIOS[sys.argv[1]]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        scenario(rank, world)
    finally:
        dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
