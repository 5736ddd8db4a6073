"""What a model's layers keep, declared by the model (`model.layer_plan`): the store sizes
the request slot from it and the executor picks how steps run from it, instead of probing
the model for attributes.

- attention: trunk layers with KV pages (all of them for a llama);
- recurrent: trunk layers with a recurrent state instead (Gated DeltaNet), kept in the store
  beside the KV (`store.recurrent`);
- mtp: NextN/MTP layers, stored after the trunk (indices n_layers..); their KV pages live in
  the same store, and only speculative steps read them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class LayerPlan:
    n_layers: int
    attention: tuple[int, ...]
    recurrent: tuple[int, ...] = ()
    mtp: tuple[int, ...] = ()
    # (layer, sliding window) of the windowed attention layers: a row there sees only its
    # last `window` positions, so older pages are never read (kv/store.py)
    windows: tuple[tuple[int, int], ...] = ()

    def window(self, layer: int) -> int:
        """The layer's sliding window, 0 when it attends to the whole context."""
        return dict(self.windows).get(layer, 0)

    @classmethod
    def of(cls, config) -> "LayerPlan":
        n = config.n_layers
        attention = tuple(i for i in range(n) if config.is_attention_layer(i))
        return cls(n, attention, tuple(i for i in range(n) if i not in attention),
                   tuple(range(n, n + config.nextn_layers)), windows_of(config, attention))

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """Every layer with KV pages: the trunk's attention layers, then the MTP layers."""
        return self.attention + self.mtp

    @property
    def plain(self) -> bool:
        """Attention-only, no MTP layer: every layer of the cache is read by every forward."""
        return not self.recurrent and not self.mtp

    @property
    def trunk_kv_layers(self) -> tuple[int, ...] | None:
        """The KV layers a plain forward acquires (the MTP layers are a speculative step's);
        None for a plain model, whose forwards acquire all."""
        return None if self.plain else self.attention

    def kv_config(self, config):
        """The config a KV cache is sized with: the MTP layers' indices exist too."""
        return replace(config, n_layers=self.n_layers + len(self.mtp))


def windows_of(config, layers) -> tuple[tuple[int, int], ...]:
    """(layer, window) of each windowed layer among `layers` (ModelConfig.layer_window)."""
    return tuple((i, config.layer_window(i)) for i in layers if config.layer_window(i))
