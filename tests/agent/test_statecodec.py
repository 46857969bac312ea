"""The state codec: what state_dict() calls return, as bytes with no pickle, and back."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tracehound.agent.rank.snapshot import deserialize, serialize, take
from tracehound.agent.rank.statecodec import UnsupportedState, decode_state, encode_state


def optimizer_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict(), "step": 7}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, dict):
        return (isinstance(b, dict) and list(a) == list(b)
                and all(same(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(same(x, y) for x, y in zip(a, b, strict=True)))
    return type(a) is type(b) and a == b


def test_a_model_and_optimizer_state_round_trips_exactly() -> None:
    state = optimizer_state()
    back = decode_state(encode_state(state))
    assert same(state, back)
    assert list(back["optim"]["state"]) == [0, 1, 2, 3]  # int keys stay ints
    assert isinstance(back["optim"]["param_groups"][0]["betas"], tuple)


@pytest.mark.parametrize("tensor", [
    torch.ones(3, dtype=torch.bfloat16), torch.tensor([True, False]), torch.empty(0, 4),
    torch.tensor(5), torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),  # not contiguous
    torch.randn(2, 3, dtype=torch.float16),
])
def test_every_dtype_and_layout_round_trips(tensor: torch.Tensor) -> None:
    back = decode_state(encode_state({"t": tensor}))["t"]
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_a_state_the_codec_cannot_carry_says_where_and_falls_back_to_torch_save() -> None:
    odd = {"model": {"w": torch.ones(2)}, "extra": {"rng": {1, 2}}}
    with pytest.raises(UnsupportedState, match=r"state\['extra'\]\['rng'\] is a set"):
        encode_state(odd)
    kept = {"w": torch.ones(2), "meta": [1.5, "x"]}
    taken, _ = take(kept)
    codec, payload = serialize(taken)
    assert codec == "state"
    staged, _ = take({"w": torch.ones(2), "when": complex(1, 2)})
    fallback_codec, fallback = serialize(staged)
    assert fallback_codec == "torch"
    assert deserialize(fallback_codec, fallback)["when"] == complex(1, 2)
    assert same(deserialize(codec, payload), kept)


@pytest.mark.parametrize("cut", [4, 12, -3])
def test_a_cut_payload_is_an_error_not_a_wrong_state(cut: int) -> None:
    payload = encode_state({"w": torch.arange(100.0)})
    with pytest.raises(ValueError):
        decode_state(payload[:cut])
