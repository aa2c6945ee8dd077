"""What running requests hold: in-flight tokens, KV-cache blocks and sequences.

A request enters the engine only when it fits every budget. Each budget keeps a share for
interactive traffic that bulk may never take (`interactive_reserve_share`), and, while bulk is
waiting, interactive leaves room for bulk to reach its guaranteed minimum (`bulk_min_share`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine_adapters.protocol import ModelInfo
from server.core.config import BudgetConfig
from server.scheduler.types import BULK, INTERACTIVE, Ticket, TrafficClass

BUDGET_NAMES = ("tokens", "kv_blocks", "sequences")


@dataclass(frozen=True, slots=True)
class BudgetLimits:
    tokens: int
    kv_blocks: int
    sequences: int
    block_size: int
    # The most prompt tokens the engine computes in one step: a longer prompt is prefilled in
    # chunks, over several steps (0: in one, however long).
    prefill_chunk: int = 0
    adapter_slots: int = 0  # the most distinct LoRA adapters running at once (`adapters.py`)

    @classmethod
    def from_engine(cls, config: BudgetConfig, model: ModelInfo) -> BudgetLimits:
        """Limits sized from the engine's real KV cache at the target utilisation.

        Sequences are capped by the engine's seats: a request dispatched beyond them would
        only wait inside the engine, where Sluice cannot order it.
        """
        engine = model.limits
        block_size = engine.kv_cache.block_size
        kv_blocks = max(1, math.floor(engine.kv_cache.num_blocks * config.kv_target_utilization))
        kv_tokens = kv_blocks * block_size
        tokens = config.max_running_tokens or kv_tokens
        # One request of the model's full length must still be able to run.
        tokens = max(tokens, model.max_model_len)
        kv_blocks = max(kv_blocks, -(-model.max_model_len // block_size))
        sequences = min(config.max_running_seqs, engine.max_num_seqs)
        return cls(
            tokens,
            kv_blocks,
            sequences,
            block_size,
            engine.max_batched_tokens,
            engine.adapter_slots,
        )

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.tokens, self.kv_blocks, self.sequences)

    def prefill_tokens(self, ticket: Ticket) -> int:
        """Tokens the engine prefills for `ticket`: its whole prompt, or for a continuation
        what follows its last full KV block (an engine with prefix caching holds the rest)."""
        tokens = ticket.prompt_tokens
        if ticket.resumed_tokens:
            tokens = tokens % self.block_size or 1
        return tokens

    def prefill_steps(self, ticket: Ticket) -> int:
        """Engine steps `ticket`'s prefill spans: one, or its chunks on an engine that
        prefills a long prompt a chunk a step (a chat arriving meanwhile waits behind them)."""
        chunk = self.prefill_chunk
        return -(-self.prefill_tokens(ticket) // chunk) if chunk > 0 else 1


class BudgetLedger:
    """In-use amounts of each budget, in total and per traffic class."""

    def __init__(self, limits: BudgetLimits, config: BudgetConfig) -> None:
        self.limits = limits
        self._block_size = limits.block_size
        self._limit = limits.as_tuple()
        self._bulk_cap = tuple(
            max(1, math.floor(limit * (1.0 - config.interactive_reserve_share)))
            for limit in self._limit
        )
        self._bulk_floor = tuple(math.floor(limit * config.bulk_min_share) for limit in self._limit)
        self._total = [0, 0, 0]
        self._by_class = {traffic_class: [0, 0, 0] for traffic_class in TrafficClass}

    def demand(self, ticket: Ticket) -> tuple[int, int, int]:
        """What one running ticket holds of (tokens, kv_blocks, sequences)."""
        tokens = ticket.reserved_tokens
        return (tokens, -(-tokens // self._block_size), ticket.n)

    def class_cap(self, traffic_class: TrafficClass) -> tuple[int, ...]:
        return self._limit if traffic_class is INTERACTIVE else self._bulk_cap

    def ever_fits(self, ticket: Ticket) -> bool:
        """Whether the ticket could run at all, with its class's share of an idle engine."""
        cap = self.class_cap(ticket.traffic_class)
        tokens, blocks, sequences = self.demand(ticket)
        return tokens <= cap[0] and blocks <= cap[1] and sequences <= cap[2]

    def fits(self, ticket: Ticket, *, bulk_waiting: bool, freeing: Sequence[Ticket] = ()) -> bool:
        """Whether `ticket` fits now, or once the running bulk tickets `freeing` have left."""
        demand = self.demand(ticket)
        total = self._total
        if ticket.traffic_class is BULK:
            held = self._by_class[BULK]
            for i in range(3):
                if total[i] + demand[i] > self._limit[i] or held[i] + demand[i] > self._bulk_cap[i]:
                    return False
            return True
        bulk_held = self._by_class[BULK]
        if freeing:  # (most calls free nothing: no sums to make)
            freed = [0, 0, 0]
            for leaving in freeing:
                for i, amount in enumerate(self.demand(leaving)):
                    freed[i] += amount
            if any(freed):
                total = [t - f for t, f in zip(total, freed, strict=True)]
                bulk_held = [b - f for b, f in zip(bulk_held, freed, strict=True)]
        for i in range(3):
            headroom = self._limit[i]
            if bulk_waiting:
                headroom -= max(0, self._bulk_floor[i] - bulk_held[i])
            if total[i] + demand[i] > headroom:
                return False
        return True

    def fits_bulk_floor(self, ticket: Ticket) -> bool:
        """Whether a bulk ticket fits inside bulk's guaranteed minimum share."""
        demand = self.demand(ticket)
        held = self._by_class[BULK]
        for i in range(3):
            if (
                held[i] + demand[i] > self._bulk_floor[i]
                or self._total[i] + demand[i] > self._limit[i]
            ):
                return False
        return True

    def acquire(self, ticket: Ticket) -> None:
        demand = self.demand(ticket)
        held = self._by_class[ticket.traffic_class]
        for i in range(3):
            self._total[i] += demand[i]
            held[i] += demand[i]

    def release(self, ticket: Ticket) -> None:
        demand = self.demand(ticket)
        held = self._by_class[ticket.traffic_class]
        for i in range(3):
            self._total[i] -= demand[i]
            held[i] -= demand[i]
            if self._total[i] < 0 or held[i] < 0:
                raise AssertionError(f"budget {BUDGET_NAMES[i]} released below zero")

    def in_use(self) -> dict[str, int]:
        return dict(zip(BUDGET_NAMES, self._total, strict=True))

    def limits_by_name(self) -> dict[str, int]:
        return dict(zip(BUDGET_NAMES, self._limit, strict=True))

    def is_idle(self) -> bool:
        return self._total == [0, 0, 0]
