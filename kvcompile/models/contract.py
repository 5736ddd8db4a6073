"""The two declared interfaces between a model and the runtime, so that nothing is probed.

`KvAccess`: what a model may ask of the KV store (kv/store.py implements it): a layer's
buffers (`LayerKv`: pools, page table, types, rotations, decode scratch), whether a layer has
pages, the range of a forward's positions (free inside the store's bracket), and a hybrid
model's recurrent state.

`StepModel`: what the executor and the store ask of a model: its geometry (`config`), the
layers it declares (`layer_plan`: attention, recurrent, MTP), its device, and a forward over
a store. A model whose plan has recurrent layers also takes `state_begun` (the executor ran
the state's host bookkeeping) and `checkpoints` (record what rolls back to any row: a verify
step); one with MTP layers takes `return_hidden` and offers `mtp_forward`.
"""
from __future__ import annotations

from typing import Protocol

import torch

from kvcompile.kv.layer_kv import LayerKv
from kvcompile.kv.recurrent_state import RecurrentState
from kvcompile.models.config import ModelConfig
from kvcompile.models.layer_plan import LayerPlan


class KvAccess(Protocol):
    recurrent: RecurrentState | None

    def layer(self, i: int) -> LayerKv: ...

    def has_layer(self, i: int) -> bool: ...

    def check_positions(self, positions: torch.Tensor) -> tuple[int, int]: ...


class StepModel(Protocol):
    config: ModelConfig

    @property
    def layer_plan(self) -> LayerPlan: ...

    @property
    def device(self) -> torch.device: ...

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KvAccess,
                last_only: bool = False, **step_options): ...
