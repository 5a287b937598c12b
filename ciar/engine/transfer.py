"""Host <-> accelerator transfers of one engine step, each one copy that never waits for the accelerator.

    pack = HostPack(device)
    a = pack.add(torch.tensor([...]))           # a handle
    pack.send()                                  # ONE non-blocking copy of every tensor added (pinned on CUDA)
    pack[a]                                      # that tensor on the device (a view of the sent buffer)

    read = HostRead([t1, t2])                    # ONE non-blocking copy back, queued behind the step's work
    values = read.values()                       # waits for that copy only, then a flat list of ints

A blocking copy (`tensor.to("cuda")` from pageable memory, `.tolist()` of a device tensor) waits for everything the
accelerator was given; the host then cannot prepare the next step while the accelerator runs this one (the engine's
overlap, `ciar.engine.core`). These two are what the runner (a step's inputs) and the judge (its decisions) move.
"""

from __future__ import annotations

import torch

__all__ = ["HostPack", "HostRead", "to_device"]

# bytes: every section of a HostPack starts at a multiple: the widest element it holds (8), and the 16 bytes that
# torch.compile'd kernels assume of their inputs' starts (the compiled judge reads its inputs from the pack; a
# section off that alignment is copied before the call)
_ALIGN = 16


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t.to(device, dtype)` without waiting for the accelerator: a host tensor goes to CUDA through pinned memory by a
    non-blocking copy (a plain `.to` from pageable memory waits for everything queued before it)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory().to(device, non_blocking=True)
    return t.to(device, dtype) if dtype is not None else t.to(device)


class HostPack:
    """Host tensors of one step, packed into one byte buffer and sent to the device in one copy (pinned memory and
    a non-blocking copy on CUDA; on a CPU the tensors are used where they are)."""

    def __init__(self, device: torch.device, pack: bool | None = None):
        """`pack`: copy through one byte buffer (default: off the CPU; True on a CPU tests the packing)."""
        self.device = torch.device(device)
        self.pack = self.device.type != "cpu" if pack is None else bool(pack)
        self._host: list[torch.Tensor] = []
        self._layout: list[tuple[int, int, torch.dtype, tuple]] = []
        self._size = 0
        self._sent: list[torch.Tensor] | None = None

    def add(self, t: torch.Tensor) -> int:
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        self._host.append(t)
        self._layout.append((self._size, nbytes, t.dtype, tuple(t.shape)))
        self._size += -(-nbytes // _ALIGN) * _ALIGN
        return len(self._host) - 1

    def send(self) -> None:
        if not self.pack:
            self._sent = self._host
            return
        # (pinned memory from PyTorch's caching host allocator: it is not reused before the copy has run)
        buf = torch.empty(self._size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        for t, (off, nbytes, _, _) in zip(self._host, self._layout):
            if nbytes:
                buf[off:off + nbytes] = t.reshape(-1).view(torch.uint8)
        dev = buf.to(self.device, non_blocking=True)
        self._sent = [dev[off:off + nbytes].view(dtype).view(shape) for off, nbytes, dtype, shape in self._layout]

    def __getitem__(self, handle: int) -> torch.Tensor:
        return self._sent[handle]


class HostRead:
    """Device tensors of one step read back as one flat list of ints: concatenated on the device, copied into pinned
    memory by one non-blocking copy queued behind the work that makes them, and an event recorded after it.
    `values()` waits for that event only (on a CPU the values are there at once): work queued after the read (the
    next step's forward) runs on meanwhile."""

    def __init__(self, parts: list[torch.Tensor]):
        self._event = None
        if not parts:
            self._host = None
            return
        flat = torch.cat([p.reshape(-1).long() for p in parts])
        if flat.device.type == "cuda":
            self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = flat

    def ready(self) -> bool:
        """The values are on the host (reading them would not wait)."""
        return self._event is None or self._event.query()

    def values(self) -> list[int]:
        if self._host is None:
            return []
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
