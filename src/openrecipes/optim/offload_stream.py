"""The update of offloaded optimizer state on the GPU: the state stays in pinned host memory between steps and
streams through the GPU in chunks during the step (``offload.update: device``).

Per chunk: its moments and master (or remainder) are copied in on one CUDA stream, the fused Adam kernel updates
them together with the parameter and gradient (which never leave the GPU) on the compute stream, and the new state
is copied back on a third stream. A few staging slots let the copy in of chunk i+1, the update of chunk i and the
copy back of chunk i-1 run at once, so the step costs about the time to move the offloaded state across the host
link once in each direction, instead of a CPU Adam over it. The arithmetic is the on-GPU update's, element for element.
"""

from __future__ import annotations

from typing import Callable

import torch

STATE_KEYS = ("exp_avg", "exp_avg_sq", "master", "remainder")


class StreamedStateUpdate:
    """Runs ``update(param_chunk, grad_chunk, state_chunks)`` on the GPU for host-resident state, chunk by chunk."""

    def __init__(self, *, chunk_elements: int = 1 << 24, slots: int = 3) -> None:
        self.chunk_elements = chunk_elements
        self.slots = slots
        self._buffers: list[dict[tuple[str, torch.dtype], torch.Tensor]] = [{} for _ in range(slots)]
        self._copy_in: torch.cuda.Stream | None = None
        self._copy_out: torch.cuda.Stream | None = None
        self._pending = False

    def _staging(self, slot: int, key: str, like: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
        buffers = self._buffers[slot]
        buffer = buffers.get((key, like.dtype))
        if buffer is None:
            buffer = buffers[(key, like.dtype)] = torch.empty(self.chunk_elements, dtype=like.dtype, device=device)
        return buffer[:n]

    def run(self, items: list[tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]],
            update: Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], int], None]) -> None:
        """``items``: (parameter on the GPU, its gradient on the GPU, its host state by key). ``update`` gets flat
        chunks of the parameter and gradient, the chunk's state on the GPU, and the item's index."""
        if not items:
            return
        device = items[0][0].device
        compute = torch.cuda.current_stream(device)
        if self._copy_in is None:
            self._copy_in, self._copy_out = torch.cuda.Stream(device), torch.cuda.Stream(device)
        copy_in, copy_out = self._copy_in, self._copy_out
        copy_in.wait_stream(compute)  # gradients are complete, and the last step's copies back are ordered before
        freed = [None] * self.slots   # the copy back that last used each slot
        chunk_index = 0
        for index, (param, grad, host_state) in enumerate(items):
            flat_param, flat_grad = param.view(-1), grad.reshape(-1)
            flat_state = {key: host_state[key].view(-1) for key in STATE_KEYS if key in host_state}
            for start in range(0, flat_param.numel(), self.chunk_elements):
                stop = min(start + self.chunk_elements, flat_param.numel())
                slot = chunk_index % self.slots
                chunk_index += 1
                with torch.cuda.stream(copy_in):
                    if freed[slot] is not None:
                        copy_in.wait_event(freed[slot])
                    staged = {key: self._staging(slot, key, value, stop - start, device).copy_(
                        value[start:stop], non_blocking=True) for key, value in flat_state.items()}
                    loaded = copy_in.record_event()
                compute.wait_event(loaded)
                update(flat_param[start:stop], flat_grad[start:stop], staged, index)
                updated = compute.record_event()
                with torch.cuda.stream(copy_out):
                    copy_out.wait_event(updated)
                    for key, value in staged.items():
                        flat_state[key][start:stop].copy_(value, non_blocking=True)
                    freed[slot] = copy_out.record_event()
        compute.wait_stream(copy_out)  # the next step reads the state only after this step's copies back
        self._pending = True

    def wait(self) -> None:
        """Block the host until the copies back have landed (before the host reads or writes the state)."""
        if self._pending:
            torch.cuda.synchronize()
            self._pending = False
