"""Prefix reuse: a request resumes at the longest common prefix of its tokens and the history
its store already holds.

The history outlives its request (the host copy is authoritative; an all-resident store's
device pages are it), so a chat's next turn, an agent's next call or the same prompt again
prefill only what is new. The store keeps the token ids its rows were computed from
(`tokens`, the engine's record of the request: prompt, generated tokens, and a stop token a
pipelined step fed past the end); `resume` compares a new prompt with them, keeps the
common prefix's pages and drops the rest. At least the prompt's last token is computed again
(its logits start the decode). The kept prefix ends on the ubatch grid (up to ubatch - 1
rows are computed again): the prefill's chunks then fall where a cold prefill's fall, so
rows that came from prefill give a cold run's logits bit for bit (chunked kernels round
by where a chunk starts); the same prompt again computes its last chunk again.

A hybrid model's recurrent layers have no pages to cut: their state exists only where it was
saved. `StateCheckpoints` keeps copies of it in host memory (pinned on CUDA) at positions
taken during prefill (chunk starts every `spacing` tokens and the last chunk's, and where the
prompt ends), up to a number of slots (`ctx_checkpoints`, llama.cpp's name), lowest
position evicted first. A resume restarts the recurrent layers at the grid point when the
state exists there (a checkpoint or the live state), else at the latest point before the
prefix end where it does (the live state or a checkpoint: exact up to rounding); the
attention layers' pages are cut at the same point.
"""
from __future__ import annotations

import weakref

import torch


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class StateCheckpoints:
    def __init__(self, state, slots: int):
        self.state, self.slots = state, max(0, int(slots))
        self.pinned = state.conv.device.type == "cuda"
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._free: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def nbytes(self) -> int:
        """Host bytes the slots take once filled."""
        return self.slots * self.state.nbytes

    def _buffers(self):
        if self._free:
            return self._free.pop()
        if len(self.saved) < self.slots:
            return (torch.empty(self.state.conv.shape, dtype=self.state.conv.dtype,
                                device="cpu", pin_memory=self.pinned),
                    torch.empty(self.state.ssm.shape, dtype=self.state.ssm.dtype,
                                device="cpu", pin_memory=self.pinned))
        return self.saved.pop(min(self.saved))        # the lowest position goes

    def save(self, position: int) -> None:
        """A copy of the state as it stands, which has consumed `position` tokens (queued on
        the current stream: the host never reads it)."""
        if not self.slots or position in self.saved or position <= 0:
            return
        conv, ssm = self._buffers()
        conv.copy_(self.state.conv, non_blocking=True)
        ssm.copy_(self.state.ssm, non_blocking=True)
        self.saved[position] = (conv, ssm)

    def best(self, n: int) -> int | None:
        """The latest saved position at or before n."""
        return max((p for p in self.saved if p <= n), default=None)

    def restore(self, position: int) -> None:
        conv, ssm = self.saved[position]
        self.state.conv.copy_(conv, non_blocking=True)
        self.state.ssm.copy_(ssm, non_blocking=True)
        self.state.n_tokens = position

    def put(self, position: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """A checkpoint at `position` from copies held elsewhere (a saved history)."""
        if not self.slots or position <= 0:
            return
        mine = self.saved.pop(position, None) or self._buffers()
        mine[0].copy_(conv)
        mine[1].copy_(ssm)
        self.saved[position] = mine

    def truncate(self, n: int) -> None:
        """Checkpoints past position n are of another history now."""
        for p in [p for p in self.saved if p > n]:
            self._free.append(self.saved.pop(p))

    def clear(self) -> None:
        self.truncate(-1)


class PrefixState:
    def __init__(self, store, ctx_checkpoints: int = 0):
        self.store = weakref.proxy(store)     # the store owns this: no cycle (streamer.py)
        self.tokens: list[int] = []        # ids at positions 0.. (the engine's record)
        state = store.recurrent
        self.checkpoints = (StateCheckpoints(state, ctx_checkpoints) if state is not None
                            else None)
        self.spacing = 0                   # tokens between prefill checkpoints
        self._last_saved = 0

    def held(self, layers=None) -> list[int]:
        """The token ids of the positions whose KV the store holds (its trunk layers')."""
        return self.tokens[:self.store.rows(layers)]

    def resume(self, prompt: list[int], ubatch: int, trunk=None, mtp=()) -> int:
        """Keep the longest prefix of the held history that the prompt repeats (all but
        the prompt's last token at most), cut back to the ubatch grid (module doc), drop the
        rest; returns the first position to compute (0: nothing reused, the store was
        reset). trunk: the layers a trunk forward acquires (default: all); mtp: the MTP
        layers an MTP drafter will read, whose own rows must reach the resume point too
        (the drafter feeds them from there)."""
        store = self.store
        n = min(common_prefix(self.held(trunk), prompt), len(prompt) - 1)
        if mtp:
            n = min(n, store.rows(mtp))
        grid = n // ubatch * ubatch          # where a cold prefill's chunk starts
        if store.recurrent is None or grid <= 0 or self._restore_at(grid):
            n = grid
        else:
            n = self._recurrent_point(n)
        if n <= 0:
            store.reset()
            return 0
        store.truncate(n)
        self._last_saved = n
        return n

    def _restore_at(self, p: int) -> bool:
        """The recurrent state at position p, if it exists: live there, or a checkpoint
        (restored); False if neither."""
        if self.store.recurrent.n_tokens == p:
            return True
        if self.checkpoints is not None and p in self.checkpoints.saved:
            self.checkpoints.restore(p)
            return True
        return False

    def _recurrent_point(self, n: int) -> int:
        """The latest position <= n where the recurrent state exists (live, or a checkpoint,
        which is then restored): the attention layers resume there too."""
        state = self.store.recurrent
        live = state.n_tokens if state.n_tokens <= n else -1
        saved = self.checkpoints.best(n) if self.checkpoints is not None else None
        if saved is not None and saved > live:
            self.checkpoints.restore(saved)
            return saved
        return max(live, 0)

    def plan(self, n_tokens: int, ubatch: int) -> None:
        """The spacing of a request's prefill checkpoints: its slots spread over the
        context it will reach, never closer than a prefill chunk."""
        if self.checkpoints is not None and self.checkpoints.slots:
            self.spacing = max(ubatch, -(-n_tokens // self.checkpoints.slots))

    def prefill_chunk(self, start: int, last: bool = False) -> None:
        """Before the prefill chunk at `start`: the state there is saved when due, and
        before the prompt's last chunk (where the same prompt again resumes)."""
        if self.checkpoints is None:
            return
        if last or (self.spacing and start - self._last_saved >= self.spacing):
            self.checkpoints.save(start)
            self._last_saved = start

    def prompt_end(self, position: int) -> None:
        """The prompt is prefilled up to `position`: a checkpoint there (where the next
        turn of a conversation resumes)."""
        if self.checkpoints is not None:
            self.checkpoints.save(position)
            self._last_saved = position

    def truncate(self, n: int) -> None:
        if self.checkpoints is not None:
            self.checkpoints.truncate(n)
        self._last_saved = min(self._last_saved, n)

    def adopt(self, tokens: list[int], checkpoints: dict) -> None:
        """A saved history's ids and recurrent checkpoints (position -> (conv, ssm)) are
        the store's now (after its pages and state: kv/snapshot.py)."""
        self.tokens = list(tokens)
        for p, (conv, ssm) in sorted(checkpoints.items()):
            if self.checkpoints is not None:
                self.checkpoints.put(p, conv, ssm)
        self._last_saved = max(checkpoints, default=0)

    def forget(self) -> None:
        self.tokens = []
        if self.checkpoints is not None:
            self.checkpoints.clear()
        self._last_saved = 0
