"""The compiled wrapper of a one-tensor collective: the hot path of most jobs.

`_collective_source` writes the wrapper's source for the function's own parameters
(`_COLLECTIVE_WRAPPER` behind one of two headers); `_Installer.wrap_collective` compiles it.
`_is_leaf` tells which functions call no other wrapped function (their wrappers only read the
depth guard)."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

from tracehound.agent.rank.hooks.catalog import _WRAPPED, _WRAPPED_NAMES, _Spec

_COLLECTIVE_WRAPPER = '''
    if _inside and _get_ident() in _inside:
        return _original(CALL)
    _token = _counted = None
    try:
        if _group is None:
            _default = _groups.default
            _name = _default[1] if _default is not None else _groups.name(None)
        elif _group is _non_member:
            _name = ""
        else:
            _name = _groups.name(_group)
        if _name:
            if _tensor is None:
                _nbytes, _dtype = 0, ""
            else:
                _nbytes = _tensor.nbytes
                _dtype = _tensor.dtype  # named off the training thread (`dtype_name`)
            if _async:
                _token = _begin(_name, _op, _nbytes, _dtype)
                _counted = _token[0].counted
            else:  # Recorder.enter, inline: no lock (a new group is added under it)
                _state = _states.get(_name) or _group_state(_name)
                _seq = next(_state.seqs)
                _entered = NOW
                _state.last = _token = (_state, _seq, _op, _nbytes, _dtype, -1, _entered)
                _counted = _state.counted
    except Exception as _exc:
        _recorder.note_error(_op, _exc)
    if _counted is not None:  # DDP's group, its steps counted (_DdpCount)
        _before = _counted.enter()
    _guard = GUARD
    if _guard:
        _me = _get_ident()
        _inside.add(_me)
    try:
        _result = _original(CALL)
    except BaseException:
        if _guard:
            _inside.discard(_me)
        if _counted is not None:
            _counted.around(_before)
        _failed(_token, _op)
        raise
    if _guard:
        _inside.discard(_me)
    if _counted is not None:
        _counted.around(_before)
    if _token is not None:
        try:
            if _async:
                _finish_work(_op, _token, _result, ordered=True)
            elif _state.device:  # complete when the device has done it, not on return
                _recorder.returned(_token)
            else:  # Recorder.returned, inline (its _offer too)
                _now = NOW
                if _seq > _state.returned[0]:
                    _state.returned = (_seq, _now)
                _item = (_recorder.ident, _name, _seq, _op, _nbytes, _dtype, -1, False,
                         _entered, _now)
                if _queue is not None and len(_queue) < _bound:
                    _queue.append(_item)
                elif not _recorder.disabled and not _recorder.sink.offer(_item):
                    _recorder.count_dropped()
        except Exception as _exc:
            _recorder.note_error(_op, _exc)
    return _result
'''
"""The body of a one-tensor collective's wrapper (`_Installer.wrap_collective`), after one of
two headers, which bind `_group`, `_async` and `_tensor`. Replaced in it when it is compiled:
`CALL`, the arguments that call the original again as it was called; `NOW`, the recorder's clock
in ns; `GUARD`, whether the call sets the depth guard (`_guard_expression`). Every name the body
uses itself starts with `_`."""

_ANY_HEADER = '''def wrapper(*args, **kwargs):
    _n = len(args)
    if kwargs:
        _group = kwargs.get("group", args[{group_pos}] if {group_pos} < _n else None)
        _async = kwargs.get("async_op", args[{async_pos}] if {async_pos} < _n else False)
        _tensor = (kwargs.get({tensor_name}, args[{tensor_pos}] if {tensor_pos} < _n else None)
                   if {tensor_name} else None)
    else:
        _group = args[{group_pos}] if {group_pos} < _n else None
        _async = args[{async_pos}] if {async_pos} < _n else False
        _tensor = args[{tensor_pos}] if {tensor_pos} < _n else None'''
"""The header for a function whose parameters cannot be written out: the three are read from
the call as given (a parameter the function lacks is at a position no call reaches)."""


def _guard_expression(spec: _Spec, leaf: bool) -> str:
    """When a call sets the depth guard: always, unless `leaf` (its code calls no wrapped
    function, `_is_leaf`); a leaf's call with a tensor subclass too, which may dispatch back
    into the same function (`__torch_function__`: all_reduce does)."""
    if not leaf:
        return "True"
    if spec.tensor_pos < 0:
        return "False"
    return "type(_tensor) is not _plain_tensor and _tensor is not None"


def _collective_source(original: Callable[..., Any], spec: _Spec, namespace: dict[str, Any],
                       *, leaf: bool, wall_clock: bool) -> str:
    """The source of the wrapper of `original`: with `original`'s own parameters and their
    defaults (put in `namespace` as `_default_<i>`) when they can be written out, else with
    `*args, **kwargs` (`*args`, `**kwargs`, positional-only parameters, a name starting with
    `_`, the body's own, or a decorator with parameters of its own). The original then gets
    every argument explicitly, bound to the parameter it was given for (a default as the
    default object itself). `leaf`: see `_guard_expression`; `wall_clock`: the recorder's clock
    is `time.time_ns` (else its `clock()`, in us, times 1000)."""
    body = (_COLLECTIVE_WRAPPER.replace("NOW", "_time_ns()" if wall_clock else "_clock() * 1000")
            .replace("GUARD", _guard_expression(spec, leaf)))
    try:
        signature = inspect.signature(original)
        outer = inspect.signature(original, follow_wrapped=False)
    except (TypeError, ValueError):
        parameters = []
        fixed = False
    else:
        parameters = list(signature.parameters.values())
        # a decorator (torch's loggers) takes *args, **kwargs and passes them on: the inner
        # signature is what it accepts. One that declares parameters of its own may accept
        # more than the inner one.
        forwards = [p.kind for p in outer.parameters.values()] == [
            inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]
        fixed = (outer == signature or forwards) and all(
            p.name.isidentifier() and not p.name.startswith("_")
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in parameters)
    if not fixed:
        group_pos, async_pos, tensor_pos = (pos if pos >= 0 else sys.maxsize for pos in (
            spec.group_pos, spec.async_pos, spec.tensor_pos))
        header = _ANY_HEADER.format(
            group_pos=group_pos, async_pos=async_pos, tensor_pos=tensor_pos,
            tensor_name=repr(spec.tensor_name if spec.tensor_pos >= 0 else ""))
        return header + body.replace("CALL", "*args, **kwargs")
    declared: list[str] = []
    passed: list[str] = []
    for index, p in enumerate(parameters):
        if p.kind is p.KEYWORD_ONLY and "*" not in declared:
            declared.append("*")
        if p.default is p.empty:
            declared.append(p.name)
        else:
            namespace[f"_default_{index}"] = p.default
            declared.append(f"{p.name}=_default_{index}")
        passed.append(f"{p.name}={p.name}" if p.kind is p.KEYWORD_ONLY else p.name)
    names = [p.name for p in parameters]

    def read(pos: int, absent: str) -> str:
        return names[pos] if pos >= 0 else absent

    header = (f"def wrapper({', '.join(declared)}):\n"
              f"    _group, _async, _tensor = {read(spec.group_pos, 'None')}, "
              f"{read(spec.async_pos, 'False')}, {read(spec.tensor_pos, 'None')}")
    return header + body.replace("CALL", ", ".join(passed))


def _is_leaf(fn: Callable[..., Any], depth: int = 3) -> bool:
    """Whether `fn` cannot call another wrapped function: no name its code uses is one, nor is
    one used by the code of a function of its module it calls, `depth` levels down (through
    decorators and what they close over). Anything that cannot be looked into (no code, no
    module) counts as a call that could."""
    fn = inspect.unwrap(fn)  # torch's logging decorators: the function they call
    code = getattr(fn, "__code__", None)
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    if code is None or module is None:
        return False
    for cell in fn.__closure__ or ():  # a function it closes over may be the one it calls
        try:
            inner = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if hasattr(inner, _WRAPPED):
            return False
        if inspect.isfunction(inner):
            if depth <= 0 or not _is_leaf(inner, depth - 1):
                return False
        elif callable(inner) and not (inspect.isclass(inner) or inspect.isbuiltin(inner)):
            return False  # a partial, a bound method, ...: not looked into
    names: set[str] = set()
    todo = [code]
    while todo:
        current = todo.pop()
        names.update(current.co_names)
        todo.extend(c for c in current.co_consts if inspect.iscode(c))
    # its own name: the `__torch_function__` dispatch of tensor subclasses calls it again (the
    # wrapper takes the leaf path for plain tensors only)
    own = fn.__name__
    if names & (_WRAPPED_NAMES - {own}):
        return False
    for name in names - {own}:
        target = getattr(module, name, None)
        if target is None or inspect.isclass(target) or inspect.ismodule(target):
            continue
        if hasattr(target, _WRAPPED):
            return False
        if inspect.isfunction(target) and (depth <= 0 or not _is_leaf(target, depth - 1)):
            return False
    return True

