"""The workers: the model version each holds, which are up, which are free, and the lease
each runs. A worker runs one batch at a time; a lost one is down until it is back up."""

from __future__ import annotations

import heapq

from server.fixed_batch.leases import Lease


class WorkerPool:
    def __init__(self, workers: tuple[str, ...]) -> None:
        self.model = list(workers)  # by worker id
        self._lease: list[Lease | None] = [None] * len(workers)
        self._up = [True] * len(workers)
        self._of_model: dict[str, list[int]] = {}
        self._free: dict[str, list[int]] = {}  # heaps of free worker ids, by model
        for worker_id, model in enumerate(workers):
            self._of_model.setdefault(model, []).append(worker_id)
            heapq.heappush(self._free.setdefault(model, []), worker_id)

    @property
    def models(self) -> list[str]:
        return list(self._of_model)

    def has_free(self, model: str) -> bool:
        return bool(self._free[model])

    def earliest_free(self, model: str, now: float) -> float:
        """The soonest a worker of `model` is expected free (now, if all are down: a restart
        is assumed)."""
        if self._free[model]:
            return now
        finishes = [
            lease.expected_finish
            for w in self._of_model[model]
            if (lease := self._lease[w]) is not None
        ]
        return max(now, min(finishes)) if finishes else now

    def take(self, model: str) -> int:
        """The lowest free worker of `model`, now busy (`runs` names its lease)."""
        return heapq.heappop(self._free[model])

    def runs(self, worker_id: int, lease: Lease) -> None:
        self._lease[worker_id] = lease

    def finished(self, worker_id: int) -> None:
        """Its batch answered: free again, if it is up."""
        self._lease[worker_id] = None
        if self._up[worker_id]:
            heapq.heappush(self._free[self.model[worker_id]], worker_id)

    def lost(self, worker_id: int) -> Lease | None:
        """It died (mid-batch or idle) and is down until `restored`; the lease it ran."""
        self._up[worker_id] = False
        free = self._free[self.model[worker_id]]
        if worker_id in free:
            free.remove(worker_id)
            heapq.heapify(free)
        lease, self._lease[worker_id] = self._lease[worker_id], None
        return lease

    def restored(self, worker_id: int) -> None:
        if self._up[worker_id]:
            return
        self._up[worker_id] = True
        if self._lease[worker_id] is None:
            heapq.heappush(self._free[self.model[worker_id]], worker_id)
