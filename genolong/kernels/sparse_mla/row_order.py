"""Whether the selection rows reaching the key-chunked sparse backward ascend, learned without a host sync.

The key-chunked backward (sparse_mla/op.py) walks each query's slots key chunk by key chunk. Rows that
ascend apart from their empty slots (the fused indexer writes them so) can be walked as they are;
other rows are sorted first (130 ms of a 128k step when every row was). Which of the two to do is a
question of speed only: the kernel addresses keys absolutely, so any row walked with the ranges
`key_chunk_rows` gives it (every valid slot in exactly one chunk's range) yields the same dq and dkv;
an unsorted row that does not ascend only loses the chunk's L2 locality.

Asking the GPU each query chunk whether its rows ascend (`bool(...)`) cost a host sync per chunk
(77 a 128k step): each one drains the queue and leaves the GPU idle while the host queues the next
launches (GPU busy 97% -> 94% when the check came in). So the answer travels back behind an event
instead: each chunk's flag is copied to pinned memory without blocking and read once its event has
completed. Until an answer arrives the last one stands (at first: ascending), so a producer whose rows
do not ascend costs a few unsorted chunks before sorting starts, never a wrong gradient.
"""

from __future__ import annotations

from collections import deque

import torch

# Flags in flight; older ones are dropped (their answer is stale) so a long run holds no more than this.
MAX_PENDING = 64


class RowOrder:
    """The latest known answer to "do the rows ascend?" and the answers still on their way."""

    def __init__(self) -> None:
        self.ascend = True
        self._pending: deque = deque()

    def latest(self) -> bool:
        """The newest answer that has arrived (no wait: completed events only)."""
        while self._pending and self._pending[0][1].query():
            flag, _ = self._pending.popleft()
            self.ascend = bool(flag)  # a pinned host tensor whose copy has completed: no device sync
        return self.ascend

    def send(self, ascends: torch.Tensor) -> None:
        """Queue this chunk's answer (a 0-d bool tensor on the rows' device) without waiting for it."""
        if not ascends.is_cuda:  # CPU (the interpreter's tests): the value is already here
            self.ascend = bool(ascends)
            return
        host = torch.empty((), dtype=torch.bool, pin_memory=True)
        host.copy_(ascends, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._pending.append((host, done))
        while len(self._pending) > MAX_PENDING:
            self._pending.popleft()
