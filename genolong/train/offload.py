"""Layer inputs parked in host memory between forward and backward (the original recipe's CPU offload).

With full recompute (genolong.train.recompute) each layer keeps exactly one tensor for
backward: its input, the 4-stream mHC residual `[B, T, 4, hidden]`. torch's non-reentrant
checkpoint saves that input through the saved-tensor machinery, so a
`torch.autograd.graph.saved_tensors_hooks` pair placed *around* the checkpoint call sees it
(and nothing else: the checkpoint's own hooks sit inside and take every tensor the layer saves).
The `Offload` wrapper sits around each `Recompute` wrapper and puts
`HostOffloader.hooks(layer_idx)`, that pair, around its call:

- pack (forward): copy the input into a host buffer on a dedicated device-to-host stream that
  first waits for the tensor to be produced; the GPU tensor is released as soon as the layer loop
  drops it (`record_stream` stops the allocator from reusing it before the copy has read it).
- unpack (backward, when the checkpoint recomputes the layer): copy it back on a dedicated
  host-to-device stream. Every unpack also starts the upload of the *next* layer that backward
  will need (the nearest earlier offloaded one), so that copy overlaps this layer's recompute
  and backward; at most one prefetched input is on the GPU at a time.

Host buffers are page-locked ("pinned": the seed measured pinned copies 22% faster than
pageable ones, and only pinned copies are truly asynchronous). They come from a pool owned by
the offloader and registered with `cudaHostRegister` at their exact size: torch's caching host
allocator rounds every pinned block up to a power of two, which at 512k tokens can waste half
the host RAM that is the limit here. A buffer returns to the pool when the saved tensor that
holds it is freed (after its backward), so `pinned_bytes()` (live offloaded data) is back to 0
after every step and the pool (`reserved_bytes()`) stays the same size from step to step.

Storage (`storage="fp8"`, finetune's `--layer-inputs fp8`): every layer input the hooks pack, kept on
the device or sent to the host, is stored as float8_e4m3fn with one float32 scale per row
(genolong.train.fp8_rows: 1 byte an element plus 4 a row, about half of bf16) and rebuilt in its own
dtype at unpack. On CUDA the quantization runs on the compute stream before the download (the host
buffer holds the fp8 bytes and scales) and the dequantization on the compute stream after the
upload. Only the layer-input chain is stored so; `park()`ed results (genolong.train.keep) stay exact.
The forward is unchanged (it ran on the exact input); backward's recompute runs on the rebuilt one.

On a machine without CUDA the same code runs with pageable buffers and plain copies, so the
CPU tests exercise packing, the pool, prefetch order and release.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from genolong.errors import GenolongError
from genolong.train.fp8_rows import pack_fp8, packed_nbytes, quantizable, unpack_fp8
from genolong.train.wrapper import ModuleWrapper

# Tensors below this size are not worth a copy (the checkpoint also saves tiny bookkeeping
# tensors); they stay where they are.
MIN_OFFLOAD_BYTES = 64 * 1024
_PAGE = 4096
STORAGE_CHOICES = ("bf16", "fp8")


@dataclass(eq=False)
class _Buffer:
    """One host buffer of the pool: `data` is a flat uint8 tensor of exactly `nbytes`."""

    data: torch.Tensor
    nbytes: int
    pinned: bool
    registered_ptr: int | None = None  # cudaHostRegister'ed base pointer, to unregister
    backing: torch.Tensor | None = None  # the over-allocated tensor `data` is a page-aligned view of
    # The upload that last read this buffer: the next download into it must wait for it.
    last_read: object | None = None


@dataclass(eq=False)
class _Saved:
    """What pack returns for an offloaded tensor: the host copy plus how to rebuild the tensor."""

    order: int
    layer_idx: int
    buffer: _Buffer
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    fp8: bool = False  # the host copy is genolong.train.fp8_rows' packing, not the tensor's bytes
    copied: object | None = None  # event: the download has finished
    uploaded: object | None = None  # event: the prefetched upload has finished
    prefetched: torch.Tensor | None = None  # as stored (the fp8 packing in fp8 storage)

    def stored_nbytes(self) -> int:
        return packed_bytes(self.shape, self.dtype, self.fp8)

    def host_view(self) -> torch.Tensor:
        """The host copy as stored: the tensor itself, or its fp8 packing (flat uint8)."""
        nbytes = self.stored_nbytes()
        if self.fp8:
            return self.buffer.data[:nbytes]
        return self.buffer.data[:nbytes].view(self.dtype).view(self.shape)

    def rebuild(self, stored: torch.Tensor) -> torch.Tensor:
        return unpack_fp8(stored, self.shape, self.dtype) if self.fp8 else stored


@dataclass(eq=False)
class _Kept:
    """What pack returns for a tensor that stays on the device (a layer that does not offload)."""

    order: int
    tensor: torch.Tensor  # the tensor itself, or in fp8 storage its packing (flat uint8)
    fp8: tuple[torch.Size, torch.dtype] | None = None  # (shape, dtype) to rebuild from the packing

    def value(self) -> torch.Tensor:
        return self.tensor if self.fp8 is None else unpack_fp8(self.tensor, *self.fp8)


@dataclass
class OffloadStats:
    packed: int = 0  # tensors moved to the host since the last reset
    unpacked: int = 0
    prefetch_hits: int = 0  # unpacks whose upload had already been started by a prefetch
    bytes_down: int = 0
    bytes_up: int = 0
    peak_pinned_bytes: int = 0
    layers: set[int] = field(default_factory=set)
    quantized: int = 0  # layer inputs stored in fp8 (kept on the device or offloaded)
    quantized_bytes: int = 0  # their fp8 bytes and scales


class HostOffloader:
    """Moves the checkpointed inputs of the layers in `layers` to host memory (see module doc).

    layers: the layer indices whose input goes to the host (None: every layer).
    pinned: page-locked buffers (only meaningful with CUDA); False = pageable, for the ablation.
    overlap: copies on their own streams with prefetch; False = on the compute stream, in place.
    host_budget_bytes: refuse to grow the pool beyond this (host RAM is the limit at 512k+).
    storage: "bf16" keeps each layer input as it is (exact); "fp8" stores every one (on the device or
      on the host) as float8_e4m3fn with per-row scales (module doc).
    """

    def __init__(
        self,
        layers: Iterable[int] | None = None,
        *,
        pinned: bool = True,
        overlap: bool = True,
        host_budget_bytes: int | None = None,
        min_bytes: int = MIN_OFFLOAD_BYTES,
        storage: str = "bf16",
    ) -> None:
        if storage not in STORAGE_CHOICES:
            raise GenolongError(f"layer-input storage must be one of {', '.join(STORAGE_CHOICES)}, got {storage!r}")
        self.layers = None if layers is None else frozenset(layers)
        self.storage = storage
        self.pinned = pinned
        self.overlap = overlap
        self.host_budget_bytes = host_budget_bytes
        self.min_bytes = min_bytes
        self.stats = OffloadStats()
        self._free: list[_Buffer] = []
        self._all: list[_Buffer] = []
        self._live_bytes = 0
        self._order = 0
        # Saved entries of the current graph in pack order, weakly: autograd owns them, and a
        # graph dropped without backward must still free its buffers.
        self._entries: list[weakref.ReferenceType] = []
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}

    # -- what the Offload wrapper uses -------------------------------------------------------------

    def offloads(self, layer_idx: int) -> bool:
        return self.layers is None or layer_idx in self.layers

    def hooks(self, layer_idx: int) -> contextlib.AbstractContextManager:
        """Saved-tensor hooks for one layer's checkpoint call (also for layers that keep their
        input on the device: their unpack is what starts the prefetch of the next offloaded one)."""
        offload = self.offloads(layer_idx)
        # A tensor saved twice in one layer call (a tiled DSA layer's two tile chains both save each
        # input slice, genolong.train.tiling) is copied once; the layer input stays alive for the whole
        # call, so its memory cannot be reused by another tensor of the same place and shape meanwhile.
        seen: dict[tuple, weakref.ReferenceType] = {}
        return torch.autograd.graph.saved_tensors_hooks(
            lambda t: self._pack(t, layer_idx, offload, seen=seen), self._unpack
        )

    def pinned_bytes(self) -> int:
        """Host bytes holding offloaded tensors right now (0 between steps)."""
        return self._live_bytes

    def reserved_bytes(self) -> int:
        """Host bytes the pool holds, in use or free (pinned when `pinned` and CUDA)."""
        return sum(b.nbytes for b in self._all)

    def live_entries(self) -> int:
        return sum(1 for ref in self._entries if ref() is not None)

    def release(self) -> None:
        """Give every free host buffer back (unpin and free); buffers in use stay."""
        if self._streams:
            for down, up in self._streams.values():
                down.synchronize()
                up.synchronize()
        for buf in self._free:
            _unpin(buf)
        kept = [b for b in self._all if b not in self._free]
        self._free = []
        self._all = kept

    def reset_stats(self) -> None:
        """Start a step's statistics (and forget entries of graphs that are gone)."""
        self.stats = OffloadStats(peak_pinned_bytes=self._live_bytes)
        self._entries = [ref for ref in self._entries if ref() is not None]

    # -- kept results (genolong.train.keep): parked outside the saved-tensor chain -------------------

    def park(self, t: torch.Tensor, layer_idx: int):
        """Copy `t` to a host buffer of the pool now (asynchronously on CUDA); `take` gives it back.
        Unlike the layer inputs, parked tensors are not in the prefetch chain: the caller prefetches."""
        return self._pack(t, layer_idx, True, chained=False)

    def prefetch(self, entry) -> None:
        """Start uploading a parked tensor (no-op if it stayed on the device or is on its way)."""
        if isinstance(entry, _Saved) and entry.device.type == "cuda" and self.overlap and entry.prefetched is None:
            self._upload(entry)

    def take(self, entry) -> torch.Tensor:
        """A parked tensor back on its device (waits for its upload on the current stream)."""
        return entry.value() if isinstance(entry, _Kept) else self._fetch(entry)

    # -- pack / unpack ----------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor, layer_idx: int, offload: bool, chained: bool = True, seen: dict | None = None):
        key = (t.data_ptr(), t.device, tuple(t.shape), t.stride(), t.dtype, t._version) if seen is not None and t.numel() else None
        if key is not None and key in seen and seen[key]() is not None:
            return seen[key]()
        entry = self._pack_new(t, layer_idx, offload, chained)
        # (a _Kept entry in bf16 storage is the tensor itself: nothing to copy twice)
        if key is not None and (isinstance(entry, _Saved) or entry.fp8 is not None):
            seen[key] = weakref.ref(entry)
        return entry

    def _pack_new(self, t: torch.Tensor, layer_idx: int, offload: bool, chained: bool):
        order = self._order
        self._order += 1
        nbytes = t.numel() * t.element_size()
        exempt = nbytes < self.min_bytes or isinstance(t, torch.nn.Parameter) or t.device.type not in ("cuda", "cpu")
        # Only the layer-input chain is stored in fp8, never a parked result (chained=False).
        fp8 = chained and self.storage == "fp8" and not exempt and quantizable(t)
        stored = t
        if fp8:
            # On the compute stream (the current one): the download below waits for it like for any producer.
            stored = pack_fp8(t)
            nbytes = stored.numel()
            self.stats.quantized += 1
            self.stats.quantized_bytes += nbytes
        if not offload or exempt:
            entry = _Kept(order, stored, (t.shape, t.dtype) if fp8 else None)
            if chained:
                self._entries.append(weakref.ref(entry))
            return entry
        buf = self._take(nbytes, t.device)
        saved = _Saved(order, layer_idx, buf, t.shape, t.dtype, t.device, fp8=fp8)
        host = saved.host_view()
        if t.device.type == "cuda" and self.overlap:
            down, _ = self._stream_pair(t.device)
            produced = torch.cuda.current_stream(t.device).record_event()
            down.wait_event(produced)
            if buf.last_read is not None:
                down.wait_event(buf.last_read)
            with torch.cuda.stream(down):
                host.copy_(stored, non_blocking=buf.pinned)
                saved.copied = down.record_event()
            # The layer loop drops `t` (and `stored`) right after this layer; without this the allocator
            # could hand its memory to the next layer while the copy is still reading it.
            stored.record_stream(down)
        else:
            host.copy_(stored)
        self._live_bytes += nbytes
        if chained:  # (the layer-input statistics; parked results are counted by genolong.train.keep)
            self.stats.packed += 1
            self.stats.bytes_down += nbytes
            self.stats.layers.add(layer_idx)
        self.stats.peak_pinned_bytes = max(self.stats.peak_pinned_bytes, self._live_bytes)
        weakref.finalize(saved, HostOffloader._give_back, weakref.ref(self), buf, nbytes)
        if chained:
            self._entries.append(weakref.ref(saved))
        return saved

    def _unpack(self, entry):
        if isinstance(entry, _Kept):
            self._prefetch_before(entry.order)
            return entry.value()
        out = self._fetch(entry, counted=True)
        self._prefetch_before(entry.order)
        return out

    def _fetch(self, saved: _Saved, counted: bool = False) -> torch.Tensor:
        if counted:
            self.stats.unpacked += 1
        if saved.device.type == "cuda" and self.overlap:
            if saved.prefetched is None:
                self._upload(saved)
            elif counted:
                self.stats.prefetch_hits += 1
            stored = saved.prefetched
            saved.prefetched = None
            torch.cuda.current_stream(saved.device).wait_event(saved.uploaded)
        elif saved.fp8:
            # (dequantize_rows writes a fresh tensor: never a view of the buffer, which goes back to the pool)
            stored = saved.host_view().to(saved.device)
        else:
            # A fresh tensor, never a view of the buffer: the buffer goes back to the pool.
            stored = saved.host_view().to(saved.device, copy=True)
        if counted:
            self.stats.bytes_up += stored.numel() * stored.element_size()
        return saved.rebuild(stored)

    def _upload(self, saved: _Saved) -> None:
        """Start copying `saved` back to its device on the upload stream."""
        _, up = self._stream_pair(saved.device)
        compute = torch.cuda.current_stream(saved.device)
        # Allocated on the compute stream (where it will be used and freed, so the block stays in
        # that stream's pool); the upload stream waits until that allocation is safe to write.
        # In fp8 storage this is the packing; `_fetch` rebuilds the tensor from it on the compute stream.
        out = torch.empty_like(saved.host_view(), device=saved.device)
        up.wait_event(compute.record_event())
        if saved.copied is not None:
            up.wait_event(saved.copied)
        with torch.cuda.stream(up):
            out.copy_(saved.host_view(), non_blocking=saved.buffer.pinned)
            saved.uploaded = up.record_event()
        out.record_stream(up)
        saved.buffer.last_read = saved.uploaded
        saved.prefetched = out

    def _prefetch_before(self, order: int) -> None:
        """Start the upload of the offloaded entry that backward needs next (packed just before)."""
        for ref in reversed(self._entries):
            entry = ref()
            if entry is None or entry.order >= order:
                continue
            if isinstance(entry, _Saved):
                if entry.device.type == "cuda" and self.overlap and entry.prefetched is None and entry.uploaded is None:
                    self._upload(entry)
                return
        # Nothing earlier is offloaded: forget dead entries so the list does not grow.
        self._entries = [ref for ref in self._entries if ref() is not None]

    # -- the pool --------------------------------------------------------------------------------

    def _take(self, nbytes: int, device: torch.device) -> _Buffer:
        # Best fit among the free buffers: the same layer sizes recur every step.
        fits = [b for b in self._free if b.nbytes >= nbytes]
        if fits:
            buf = min(fits, key=lambda b: b.nbytes)
            self._free.remove(buf)
            return buf
        if self.host_budget_bytes is not None and self.reserved_bytes() + nbytes > self.host_budget_bytes:
            raise GenolongError(
                f"offload needs {_gib(self.reserved_bytes() + nbytes)} of host memory, more than the "
                f"{_gib(self.host_budget_bytes)} host budget; offload fewer layers (--offload-layers), keep the DSA results "
                "on the GPU or not at all (--keep-sparse device / off), or shorten --seq"
            )
        pin = self.pinned and device.type == "cuda"
        buf = _allocate(nbytes, pin)
        self._all.append(buf)
        return buf

    @staticmethod
    def _give_back(owner_ref, buf: _Buffer, nbytes: int) -> None:
        owner = owner_ref()
        if owner is None:
            return
        owner._live_bytes -= nbytes
        owner._free.append(buf)

    def _stream_pair(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]


class Offload(ModuleWrapper):
    """Runs the wrapped (recomputed) layer inside `offloader.hooks(layer_idx)` when autograd records.

    Every recomputed layer gets one, also those whose input stays on the device (their unpack starts
    the prefetch of the next offloaded one). `decide` (on layer 0 only): called with the layer's
    input at each forward that records, returns how many leading layers offload (the budget)."""

    def __init__(self, module: torch.nn.Module, offloader: HostOffloader, layer_idx: int,
                 decide: Callable[[torch.Tensor], int] | None = None) -> None:
        super().__init__(module)
        self.offloader = offloader
        self.layer_idx = layer_idx
        self.decide = decide

    def forward(self, hidden_streams: torch.Tensor, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.wrapped(hidden_streams, *args, **kwargs)
        if self.decide is not None:
            self.offloader.layers = frozenset(range(self.decide(hidden_streams)))
        with self.offloader.hooks(self.layer_idx):
            return self.wrapped(hidden_streams, *args, **kwargs)

    def extra_repr(self) -> str:
        where = "to host memory" if self.offloader.offloads(self.layer_idx) else "kept on the device"
        how = "pinned" if self.offloader.pinned else "pageable"
        if self.offloader.storage == "fp8":
            how = f"fp8 e4m3 with per-row scales, {how}" if self.offloader.offloads(self.layer_idx) else "fp8 e4m3 with per-row scales"
        budget = ", the offloaded layers decided from the GPU budget at each new length" if self.decide is not None else ""
        return f"layer {self.layer_idx}: input {where} ({how}){budget}"


def packed_bytes(shape: torch.Size, dtype: torch.dtype, fp8: bool) -> int:
    """Bytes a stored tensor of `shape` and `dtype` takes: its own, or in fp8 storage its packing."""
    if fp8:
        return packed_nbytes(shape)
    return shape.numel() * torch.empty((), dtype=dtype).element_size()


def _allocate(nbytes: int, pin: bool) -> _Buffer:
    if not pin:
        return _Buffer(torch.empty(nbytes, dtype=torch.uint8), nbytes, pinned=False)
    # Page-aligned, exact-size registration (see the module docstring for why not pin_memory=True).
    backing = torch.empty(nbytes + _PAGE, dtype=torch.uint8)
    offset = (-backing.data_ptr()) % _PAGE
    data = backing[offset : offset + nbytes]
    err = int(torch.cuda.cudart().cudaHostRegister(data.data_ptr(), nbytes, 0))
    if err != 0:
        # Registration can be refused (locked-memory limits); torch's pinned allocator still works.
        return _Buffer(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), nbytes, pinned=True)
    return _Buffer(data, nbytes, pinned=True, registered_ptr=data.data_ptr(), backing=backing)


def _unpin(buf: _Buffer) -> None:
    if buf.registered_ptr is not None:
        torch.cuda.cudart().cudaHostUnregister(buf.registered_ptr)
        buf.registered_ptr = None


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
