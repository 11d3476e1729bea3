"""Deterministic, resumable prompt order: a fresh seeded shuffle each epoch and a cursor into it."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class PromptSampler:
    """Yields batches of prompt indices; its state (epoch, cursor) is part of every PPO checkpoint."""

    n_prompts: int
    batch_size: int
    seed: int = 0
    epoch: int = 0
    cursor: int = 0

    def __post_init__(self) -> None:
        if self.n_prompts < 1:
            raise ValueError("PromptSampler needs at least one prompt; the PPO prompt table is empty")

    def _order(self, epoch: int) -> list[int]:
        order = list(range(self.n_prompts))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[int]:
        """The next ``batch_size`` indices, continuing into the next epoch's shuffle when one runs out."""
        batch: list[int] = []
        while len(batch) < self.batch_size:
            order = self._order(self.epoch)
            take = order[self.cursor : self.cursor + self.batch_size - len(batch)]
            batch.extend(take)
            self.cursor += len(take)
            if self.cursor >= self.n_prompts:
                self.epoch, self.cursor = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, int]:
        """JSON-serialisable position."""
        return {"epoch": self.epoch, "cursor": self.cursor, "n_prompts": self.n_prompts, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a position; refuses a checkpoint made for a different prompt table or seed."""
        if state["n_prompts"] != self.n_prompts or state["seed"] != self.seed:
            raise ValueError(
                f"checkpoint was made for {state['n_prompts']} prompts with seed {state['seed']}, "
                f"this run has {self.n_prompts} prompts with seed {self.seed}; resume with the same inputs"
            )
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
