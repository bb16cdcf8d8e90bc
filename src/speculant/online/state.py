"""Persistence of online adaptation: the files of a state directory, written on shutdown and read on start.

A state directory holds ``online.json`` (the drafter's version, the history of rounds, the settings and the count of
requests since the last round), ``drafter.pt`` (the draft model's own parameters, those not shared with the target;
only when the adapter distils), ``buffer.pt`` (the buffered observations) and ``traffic.pt`` (the traffic memory,
when there is one). Reading checks everything before it changes anything: a missing, truncated or foreign file, or
one for another draft model or vocabulary, is a ValueError and leaves the adapter as it was.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..core.checks import vocab_size
from .buffer import OnlineBuffer
from .config import OnlineConfig
from .traffic import TrafficMemory

__all__ = ["STATE_FILE", "load_state", "save_state"]

STATE_FILE = "online.json"
"""The file whose presence marks a state directory."""
_PARAMS_FILE, _BUFFER_FILE, _TRAFFIC_FILE = "drafter.pt", "buffer.pt", "traffic.pt"


def _own_parameters(model: torch.nn.Module, target: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of ``model``'s parameters that are not ``target``'s, by name."""
    shared = {id(p) for p in target.parameters()}
    return {name: p.detach().clone() for name, p in model.named_parameters() if id(p) not in shared}


def save_state(directory: str | Path, config: OnlineConfig, draft: torch.nn.Module | None, target: torch.nn.Module,
               buffer: OnlineBuffer, traffic: TrafficMemory | None, counters: dict[str, Any]) -> None:
    """Write the state to ``directory`` (created if need be): ``draft``'s own parameters (None: not distilling),
    ``buffer``, ``traffic`` (None: no memory) and ``counters`` (``version``, ``history``, ``since_update``) with
    ``config``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if draft is not None:
        torch.save(_own_parameters(draft, target), directory / _PARAMS_FILE)
    torch.save(buffer.state_dict(), directory / _BUFFER_FILE)
    if traffic is not None:
        torch.save(traffic.state_dict(), directory / _TRAFFIC_FILE)
    state = {"version": counters["version"], "history": counters["history"], "config": asdict(config),
             "since_update": counters["since_update"]}
    (directory / STATE_FILE).write_text(json.dumps(state, indent=1))


def load_state(directory: str | Path, draft: torch.nn.Module | None, target: torch.nn.Module, buffer: OnlineBuffer,
               traffic: TrafficMemory | None) -> dict[str, Any]:
    """Resume from :func:`save_state`'s files: ``draft``'s parameters in place (names and shapes must match; None:
    not distilling), ``buffer`` and ``traffic`` (None: no memory); returns the counters (``version``, ``history``,
    ``since_update``)."""
    directory = Path(directory)
    try:
        state = json.loads((directory / STATE_FILE).read_text())
        params = torch.load(directory / _PARAMS_FILE, weights_only=True) if draft is not None else {}
        saved_buffer = torch.load(directory / _BUFFER_FILE, weights_only=True)
        saved_traffic = torch.load(directory / _TRAFFIC_FILE, weights_only=True) \
            if traffic is not None and (directory / _TRAFFIC_FILE).exists() else None
    except Exception as e:  # noqa: BLE001: a missing, truncated or foreign file (pickle, JSON, torch errors)
        raise ValueError(f"cannot read the online state in {directory}: {type(e).__name__}: {e}") from None
    if not all(k in state for k in ("version", "history")) or "items" not in saved_buffer:
        raise ValueError(f"the online state in {directory} is incomplete (online.json or buffer.pt)")
    own = dict(draft.named_parameters()) if params else {}
    for name, value in params.items():
        if name not in own or own[name].shape != value.shape:
            raise ValueError(f"the online state in {directory} is for another draft model "
                             f"(parameter {name!r} {tuple(value.shape)} does not fit)")
    if saved_traffic is not None:
        try:  # a bad file: a ValueError before the drafter changes
            traffic.load_state_dict(saved_traffic, vocab_size(target))
        except ValueError as e:
            raise ValueError(f"the online state in {directory}: {e}") from None
    with torch.no_grad():  # in place: a packed forward sees the version counters move and rebuilds
        for name, value in params.items():
            own[name].copy_(value)
    buffer.load_state_dict(saved_buffer)
    return {"version": int(state["version"]), "history": list(state["history"]),
            "since_update": int(state.get("since_update", 0))}
