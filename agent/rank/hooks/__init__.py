"""The patches that feed the recorder: torch.distributed collectives, process groups, DDP, steps.

`install_distributed` wraps the functions of `torch.distributed` a training job communicates with
(in `torch.distributed.distributed_c10d`, and wherever `torch.distributed` or
`torch.distributed.device_mesh` hold the same function):

- collectives: all_reduce, broadcast, reduce, all_gather, all_gather_into_tensor /
  all_gather_single / _all_gather_base, reduce_scatter, reduce_scatter_tensor /
  reduce_scatter_single / _reduce_scatter_base, all_to_all, all_to_all_single, gather, scatter,
  barrier, monitored_barrier, all_reduce_coalesced, all_gather_coalesced. The aliases of one
  collective are recorded under one op name (all_gather_into_tensor, reduce_scatter_tensor), so
  members that call it by different names still agree. FSDP2 (`fully_shard`) all-gathers and
  reduce-scatters through all_gather_single / reduce_scatter_single, so it is covered.
- object collectives: all_gather_object, gather_object, broadcast_object_list,
  scatter_object_list, each recorded as ONE operation of its group under its own name, nbytes 0
  (their size is that of pickles made inside torch).
- point-to-point: send, recv, isend, irecv, send_object_list, recv_object_list, and
  batch_isend_irecv (each op of the batch recorded as its isend / irecv).
- process groups: init_process_group, new_group (and so new_subgroups,
  new_subgroups_by_enumeration), the `_new_group_with_tag` they and DeviceMesh go through,
  split_group, shrink_group, destroy_process_group.

`install_ddp` watches every DistributedDataParallel model's gradient all-reduces, which bypass
`dist.all_reduce`. With `every` 0 (what a training process gets by default,
TRACEHOUND_DDP_TRACE_EVERY) they stay on DDP's own C++ path and are counted from c10d's own
sequence counter (`_DdpCount`: the group `<group>:ddp`, in heartbeats on every step, and its
steps recorded about one per TRACEHOUND_DDP_SPAN_S), so who waits on whom and who arrives last
stay visible without a Python call in the backward pass. With `every` N > 0 the C++ reducer gets,
one training step in N, a process group of its own (`_reducer_group`: a Python subclass of
c10d's ProcessGroup that forwards to the model's real group and its backends), so each bucket is
recorded as an all_reduce call of the real group whatever comm hook the user registers (a
Python hook that calls `dist.all_reduce` is recorded by that wrapper instead); DDP keeps its own
gradient division and hook-less path, and a bucket's completion is seen without a callback on
the work (`_Reducer.settle`). The other steps are counted as with 0.
`install_optimizer` counts training steps with a global optimizer step post-hook.

A wrapper calls the original with the arguments it was given, each bound to the same parameter
(a one-tensor collective's wrapper passes them all explicitly, `_collective_source`), and
returns exactly what it returned; a user's exception is re-raised unchanged (after recording the
operation as failed). Errors of the recording itself are swallowed and counted by the recorder.
Nothing here may change what the training program computes or sees, block it, or add work per
call that a record does not need.

Sequence ids: every collective (including barrier) takes the next id of its process group, so the
same (group, seq) is the same call on every member. A wrapped function called from inside another
(torch's object collectives run two or three tensor collectives; send runs isend; the aliases call
each other) is not recorded again: a per-thread depth guard (`_inside`) lets only the outermost
call count.
Every member of an object collective runs the same internal calls (gather_object all-gathers the
sizes and gathers on every member, scatter_object_list broadcasts the size and scatters twice on
every member, ...), so counting the outer call alone keeps the ids aligned on all members.

Point-to-point operations would break the "same id on every member" rule, so they count in a
pseudo group per pair of ranks, named `<group>:p2p:<low>-<high>` (announced with a
ProcessGroupInfo of backend "p2p"), or `<group>:p2p:any` for a receive from any source; peers
given as group ranks (`group_dst` / `group_src`, P2POp's `group_peer`) are recorded as global
ranks. Calls outside a batch take their ids in the order each end makes them: blocking
send/recv pair up in program order on both ends; isend/irecv agree when both ends issue a pair's
transfers in the same order (not checked: a program may issue them in any order). The ops of one
batch_isend_irecv may be listed in any order, so they take their ids in a canonical order: per
pair, the transfers from the lower rank to the higher first, then the others, list order within
one direction (the order torch matches them in). Both ends then number a transfer alike.

Groups: a ProcessGroupInfo (the group's global ranks) is recorded once per group this rank is a
member of, when the group is created, and otherwise when it is first used (groups created before
the recorder was installed, or by a path not wrapped).

Functional collectives (`torch.distributed._functional_collectives`: DTensor redistribution,
tensor parallelism, FSDP2's gradient clipping) run as C++ ops without these Python functions:
`tracehound.agent.rank.functional` wraps their own entry points. Not covered: what a compiled graph
or funcol's autograd backward issues straight through `torch.ops._c10d_functional` (seen only
by the ranks' stacks and the job's standstill, `analysis.standstill`); DDP's own C++
collectives (parameter broadcast and shape check at construction); the communication of a
`_coalescing_manager` block, whose ops are recorded when they are queued (they end at once).
"""

from __future__ import annotations

from tracehound.agent.rank.hooks import catalog, ddp, installer, state, steps, wrappers
from tracehound.agent.rank.hooks.catalog import (
    COLLECTIVES,
    GROUP_FACTORIES,
    OP_NAMES,
    POINT_TO_POINT,
)
from tracehound.agent.rank.hooks.ddp import DdpStats, ddp_stats, install_ddp, untraced_ddp
from tracehound.agent.rank.hooks.installer import install_distributed
from tracehound.agent.rank.hooks.steps import install_checkpoint_state_dict, install_optimizer

__all__ = [
    "COLLECTIVES",
    "GROUP_FACTORIES",
    "OP_NAMES",
    "POINT_TO_POINT",
    "DdpStats",
    "catalog",
    "ddp",
    "ddp_stats",
    "install_checkpoint_state_dict",
    "install_ddp",
    "install_distributed",
    "install_optimizer",
    "installer",
    "state",
    "steps",
    "untraced_ddp",
    "wrappers",
]
