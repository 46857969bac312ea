"""What the wrappers know of torch.distributed's functions: which ones are collectives,
point-to-point calls and group factories, under which op name each is recorded, where its group,
async flag, tensor and peer are among its parameters (`_Spec`), and the depth guard shared by
every wrapper (`_inside`). Also the patching of a function wherever torch holds it (`_patch`)."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "_reduce_scatter_base", "all_to_all", "all_to_all_single", "gather",
    "scatter", "barrier", "monitored_barrier", "all_reduce_coalesced", "all_gather_coalesced",
    "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
)
POINT_TO_POINT = ("send", "recv", "isend", "irecv", "send_object_list", "recv_object_list")
GROUP_FACTORIES = ("new_group", "_new_group_with_tag", "split_group", "shrink_group")
"""Functions that return a new process group, announced with a ProcessGroupInfo."""

OP_NAMES = {
    "all_gather_single": "all_gather_into_tensor",
    "_all_gather_base": "all_gather_into_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
}
"""Aliases of one collective -> the op name it is recorded under."""

_ALWAYS_ASYNC = ("isend", "irecv")
_RETURNS_PEER = ("recv", "recv_object_list")
_TENSOR_PARAMS = ("input_tensor", "input", "tensor")
_TENSOR_LIST_PARAMS = ("input_tensor_list", "input_list", "tensors")

_WRAPPED = "__tracehound_wrapped__"


_inside: set[int] = set()
"""The threads (idents) inside a wrapped call that guards against nested ones (the depth guard,
`_guard_expression`): a call made while its thread is in here is passed on unrecorded. A set
read as a global rather than a thread-local attribute: the common call (no thread is inside)
checks only that it is empty (0.01 us against 0.04 for the attribute)."""

_get_ident = threading.get_ident


@dataclass(frozen=True, slots=True)
class _Spec:
    op: str
    group_pos: int
    async_pos: int
    tensor_pos: int
    tensor_name: str
    tensor_list: bool
    peer_pos: int
    peer_name: str
    group_peer_pos: int
    group_peer_name: str
    p2p: bool
    always_async: bool
    returns_peer: bool


def _position(params: list[str], name: str) -> int:
    return params.index(name) if name in params else -1


def _spec(op: str, fn: Callable[..., Any]) -> _Spec:
    params = list(inspect.signature(fn).parameters)
    tensor_name = next((n for n in _TENSOR_PARAMS if n in params), "")
    tensor_list = not tensor_name
    if tensor_list:
        tensor_name = next((n for n in _TENSOR_LIST_PARAMS if n in params), "")
    p2p = op in POINT_TO_POINT
    peer_name = ("dst" if "send" in op else "src") if p2p else ""
    group_peer_name = ("group_dst" if "send" in op else "group_src") if p2p else ""
    return _Spec(
        op=OP_NAMES.get(op, op), group_pos=_position(params, "group"),
        async_pos=_position(params, "async_op"),
        tensor_pos=_position(params, tensor_name), tensor_name=tensor_name,
        tensor_list=tensor_list and bool(tensor_name),
        peer_pos=_position(params, peer_name), peer_name=peer_name,
        group_peer_pos=_position(params, group_peer_name), group_peer_name=group_peer_name,
        p2p=p2p, always_async=op in _ALWAYS_ASYNC, returns_peer=op in _RETURNS_PEER,
    )


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], pos: int, name: str) -> Any:
    if name and name in kwargs:
        return kwargs[name]
    if 0 <= pos < len(args):
        return args[pos]
    return None



def _patch(modules: tuple[Any, ...], name: str, make: Callable[[Any], Any]) -> bool:
    """Replace `name` of the last module (torch's c10d) with `make(original)`, and of every other
    module that holds the same original; False when absent or already wrapped."""
    current = getattr(modules[-1], name, None)
    if current is None or hasattr(current, _WRAPPED):
        return False
    wrapper = make(current)
    for module in modules:
        if module is modules[-1] or getattr(module, name, None) is current:
            setattr(module, name, wrapper)
    return True


_WRAPPED_NAMES = frozenset(COLLECTIVES + POINT_TO_POINT + ("batch_isend_irecv",))

