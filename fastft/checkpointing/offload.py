"""Where offloaded checkpointing keeps a decoder layer's input between its forward and its backward.

On CUDA the input is copied into a pinned host buffer on a side stream, so the copy overlaps the layer's compute;
the side stream first waits for the compute stream, so it never reads the input before it is written, and the
caching allocator is told (``record_stream``) not to hand the input's memory out again before the copy is done. In
backward the copy back runs on the same side stream into memory allocated on the compute stream, and the compute
stream waits for its event before reading it. Because every copy of a buffer runs on one stream, a buffer freed after
its copy back was queued can be filled again by the next step's forward without any host-side wait.

Buffers are pooled per layer slot and reused from step to step (pinned allocations are slow and pin physical
pages); :meth:`OffloadEngine.release` drops them.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from fastft.checkpointing.replay import ReplayChain

# Buffers grow in whole MiB, so batches whose lengths differ a little share one buffer.
_GRANULE = 1 << 20


class HostBufferPool:
    """Reusable host buffers (flat ``uint8``), kept per layer slot.

    Args:
        pin_memory: Allocate page-locked memory (CUDA copies are only asynchronous from pinned memory).
    """

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self.closed = False
        self.allocations = 0
        self._free: dict[int, list[torch.Tensor]] = {}
        # Buffers come back from autograd's device thread (when a saved input is released) while the main thread may
        # be taking them for the next forward.
        self._lock = threading.Lock()

    def take(self, slot: int, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` bytes for ``slot``: a free one when one fits, else a new one."""
        with self._lock:
            free = self._free.setdefault(slot, [])
            fitting = [index for index, buffer in enumerate(free) if buffer.numel() >= nbytes]
            if fitting:
                return free.pop(min(fitting, key=lambda index: free[index].numel()))
            if free:
                # Too small for this batch; a bigger one replaces it rather than joining it.
                free.pop(max(range(len(free)), key=lambda index: free[index].numel()))
            self.allocations += 1
        size = -(-nbytes // _GRANULE) * _GRANULE
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)

    def give(self, slot: int, buffer: torch.Tensor) -> None:
        """Return a buffer taken for ``slot`` (dropped once the pool is closed)."""
        with self._lock:
            if not self.closed:
                self._free.setdefault(slot, []).append(buffer)

    def held_bytes(self) -> int:
        """Bytes of the free buffers the pool holds."""
        return sum(buffer.numel() for buffers in self._free.values() for buffer in buffers)

    def close(self) -> None:
        """Drop every free buffer and refuse the ones given back later."""
        with self._lock:
            self.closed = True
            self._free.clear()


class StreamOps:
    """The CUDA calls that order the offload copies, in one place.

    Streams and events come from here and are used through their own ``wait_stream`` / ``record_event`` /
    ``wait_event``. A test hands :class:`OffloadEngine` a stand-in that performs the copies on CPU and records the
    order of every call, which is how the copy protocol is checked without a GPU.
    """

    def new_stream(self, device: torch.device) -> Any:
        """A fresh side stream on ``device``."""
        return torch.cuda.Stream(device=device)

    def current(self, device: torch.device) -> Any:
        """The stream the caller's kernels are queued on."""
        return torch.cuda.current_stream(device)

    def copy(self, destination: torch.Tensor, source: torch.Tensor, stream: Any, label: str) -> None:
        """Queue ``destination.copy_(source)`` on ``stream`` without waiting for it (``label`` names it in traces)."""
        with torch.cuda.stream(stream):
            destination.copy_(source, non_blocking=True)

    def keep_until_done(self, tensor: torch.Tensor, stream: Any) -> None:
        """Keep the caching allocator from reusing ``tensor``'s memory before the work queued on ``stream`` ran."""
        tensor.record_stream(stream)

    def empty(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Memory on ``device``, allocated on the current stream."""
        return torch.empty(shape, dtype=dtype, device=device)


_CUDA = StreamOps()


class ParkedTensor:
    """One tensor copied off its device during the forward, brought back for the backward.

    The host copy stays until this object is freed (with the autograd node that owns it), so a second backward over
    a retained graph can bring it back again.
    """

    def __init__(self, engine: OffloadEngine, slot: int, tensor: torch.Tensor) -> None:
        self.slot = slot
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self.nbytes = tensor.numel() * tensor.element_size()
        self._pool = engine.pool(tensor.device)
        self._ops = engine.stream_ops(tensor.device)
        self._stream = engine.side_stream(tensor.device)
        self._host: torch.Tensor | None = self._pool.take(slot, self.nbytes)
        self._fetched: torch.Tensor | None = None
        self._ready: Any = None
        host = self._host_view()
        if self._ops is None:
            host.copy_(tensor)
            return
        self._stream.wait_stream(self._ops.current(self.device))
        self._ops.copy(host, tensor, self._stream, f"to host {slot}")
        self._ops.keep_until_done(tensor, self._stream)

    def _host_view(self) -> torch.Tensor:
        return self._host[: self.nbytes].view(self.dtype).view(self.shape)

    def prefetch(self) -> None:
        """Start copying the tensor back to its device, unless that has started already."""
        if self._fetched is not None:
            return
        if self._ops is None:
            self._fetched = self._host_view().clone()
            return
        # Allocated on the compute stream, which reads it only after waiting for the copy below, so the memory needs
        # no record_stream: it is freed on the compute stream after that read.
        fetched = self._ops.empty(self.shape, self.dtype, self.device)
        self._stream.wait_stream(self._ops.current(self.device))
        self._ops.copy(fetched, self._host_view(), self._stream, f"to device {self.slot}")
        self._ready = self._stream.record_event()
        self._fetched = fetched

    def take(self) -> torch.Tensor:
        """The tensor on its device, ready to be read on the current stream (unpack hook: the owner's backward)."""
        tensor = self.borrow()
        self._fetched = None
        return tensor

    def borrow(self) -> torch.Tensor:
        """The tensor on its device, ready on the current stream, and kept for the :meth:`take` that follows.

        A ``"sqrt-offload"`` segment replays its layers from a kept input before that input's own layer runs its
        backward; borrowing lets both read one copy.
        """
        self.prefetch()
        if self._ready is not None:
            self._ops.current(self.device).wait_event(self._ready)
            self._ready = None
        return self._fetched

    def __del__(self) -> None:
        host, self._host = getattr(self, "_host", None), None
        if host is not None:
            self._pool.give(self.slot, host)


class OffloadEngine:
    """Per-model state of the offloaded checkpointer: buffer pools, side streams, and the order of the layer calls.

    Args:
        park_cpu_tensors: Copy CPU tensors into (unpinned) pool buffers too. CPU training never needs it (the input is
            already in host memory); it lets a CPU test exercise the buffer and prefetch bookkeeping.
        cpu_stream_ops: Queue the copies of CPU tensors through these stream operations (a test's recording stand-in
            for CUDA's); without them CPU copies are plain synchronous copies.
    """

    def __init__(self, park_cpu_tensors: bool = False, cpu_stream_ops: StreamOps | None = None) -> None:
        self.park_cpu_tensors = park_cpu_tensors
        self.cpu_stream_ops = cpu_stream_ops
        self._pools: dict[torch.device, HostBufferPool] = {}
        self._streams: dict[torch.device, Any] = {}
        self._last: weakref.ref | None = None
        self._last_slot = -1
        self.chain = ReplayChain()

    def parks(self, tensor: torch.Tensor) -> bool:
        """Whether :meth:`park` moves ``tensor`` to host memory (CUDA tensors; CPU ones only when asked)."""
        return tensor.device.type == "cuda" or (self.park_cpu_tensors and tensor.device.type == "cpu")

    def park(self, slot: int, tensor: torch.Tensor) -> ParkedTensor:
        """Start moving ``tensor`` (the input of the layer in ``slot``) to a host buffer."""
        return ParkedTensor(self, slot, tensor)

    def pool(self, device: torch.device) -> HostBufferPool:
        """The buffer pool for tensors from ``device``."""
        if device not in self._pools:
            self._pools[device] = HostBufferPool(pin_memory=device.type == "cuda")
        return self._pools[device]

    def stream_ops(self, device: torch.device) -> StreamOps | None:
        """How copies from ``device`` are queued: CUDA's streams, or ``None`` for plain synchronous copies."""
        return _CUDA if device.type == "cuda" else self.cpu_stream_ops

    def side_stream(self, device: torch.device) -> Any:
        """The copy stream for ``device`` (``None`` where copies are synchronous)."""
        ops = self.stream_ops(device)
        if ops is None:
            return None
        if device not in self._streams:
            self._streams[device] = ops.new_stream(device)
        return self._streams[device]

    def follow(self, slot: int, call: Any) -> weakref.ref | None:
        """Record a layer call; return (weakly) the call of the layer before it in the same forward pass, if any.

        Layers run in slot order, so a call whose slot is not above the last one's starts a new forward pass (the
        next micro-batch, or a second forward before any backward) and has no predecessor.
        """
        previous = self._last() if self._last is not None and slot > self._last_slot else None
        self._last, self._last_slot = weakref.ref(call), slot
        return None if previous is None else weakref.ref(previous)

    def held_bytes(self) -> int:
        """Bytes of free host buffers kept for the next step."""
        return sum(pool.held_bytes() for pool in self._pools.values())

    def allocations(self) -> int:
        """How many host buffers were allocated since the last :meth:`release`."""
        return sum(pool.allocations for pool in self._pools.values())

    def release(self) -> None:
        """Free every pooled host buffer and side stream (buffers still holding a saved input go when it does)."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        self._streams.clear()
        self._last, self._last_slot = None, -1
        self.chain.clear()

    def __getstate__(self) -> dict[str, Any]:
        # Buffers, streams and weak references do not pickle or deep-copy; a copy starts empty.
        return {"park_cpu_tensors": self.park_cpu_tensors, "cpu_stream_ops": self.cpu_stream_ops}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)


__all__ = ["HostBufferPool", "OffloadEngine", "ParkedTensor", "StreamOps"]
