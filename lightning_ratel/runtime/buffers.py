"""Module buffers under data parallel: rank 0's values reach every rank, as ``DistributedDataParallel`` sends them.

Buffers (BatchNorm's running statistics, counters) stay on the module, on the compute device; no rank's optimizer owns
them. ``DistributedDataParallel`` with ``broadcast_buffers=True`` (its default, and Lightning's ``ddp``) broadcasts
rank 0's buffers to every rank when it is built and before each forward that follows a forward which synchronized
gradients; :class:`BufferBroadcast` is that broadcast, and the coordinator decides when it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class BufferBroadcast:
    """Overwrites a module's buffers with rank 0's, one broadcast per device and dtype.

    The buffers are looked up at each broadcast (a forward may rebind one), in ``named_buffers()`` order, which is the
    same on every rank. Those named in the module's ``_ddp_params_and_buffers_to_ignore`` stay as they are, as
    ``DistributedDataParallel`` leaves them. The bytes travel through host memory over a gloo group, also for buffers
    on a GPU: buffers are small (tables, statistics, counters), and a wait there can watch for a rank that failed,
    which a wait of NCCL's on the device's stream cannot.

    Args:
        module: the model.
        group: a gloo process group of every rank, used by the training thread only.
        wait: waits for a broadcast started asynchronously on ``group``, watching for a rank that failed and will never
            join it (:meth:`DataParallelAdam.wait <lightning_ratel.runtime.collectives.DataParallelAdam.wait>`).
    """

    def __init__(self, module: nn.Module, group: Any, wait: Callable[[Any], None]) -> None:
        self._module = module
        self._group = group
        self._wait = wait
        self._ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))

    def broadcast(self) -> None:
        """Give every rank rank 0's buffers (a collective: every rank calls it at the same point)."""
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for name, buffer in self._module.named_buffers():
            if name not in self._ignore:
                groups.setdefault((buffer.device, buffer.dtype), []).append(buffer)
        source = dist.get_rank(self._group) == 0
        with torch.no_grad():
            for buffers in groups.values():
                flat = torch.cat([b.reshape(-1) for b in buffers]).cpu()
                # As bytes: gloo sends uint8, whatever the buffers' dtype (bool, bfloat16, ...).
                self._wait(dist.broadcast(flat.view(torch.uint8), src=0, group=self._group, async_op=True))
                if source:
                    continue
                offset = 0
                for b in buffers:
                    b.copy_(flat[offset : offset + b.numel()].view(b.shape))
                    offset += b.numel()
