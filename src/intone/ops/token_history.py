"""Every running request's generated main tokens, kept on the model's device.

The samplers read a request's history (repetition penalties, repetition-aware sampling): kept here,
it never crosses to the host, a step appends its new tokens with one device write, and the head gets
fixed-shape rows [R, capacity] (-1 beyond each row's count), so it can be captured in a CUDA graph
whatever the requests' lengths.

Each request holds a seat (a row of the table) while it takes part in steps. A request absent from a
step is gone (running requests are in every step; nothing is preempted), so its seat is reused. The
table trusts nothing it cannot check: a request whose count of generated tokens differs from what
its seat recorded (a new seat, or tokens set by hand) has its row written from the host's list first.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from intone.sampling_bounds import SAMPLING_BOUNDS

CAPACITY = SAMPLING_BOUNDS["max_new_tokens"]["le"]  # tokens a request may generate


class TokenHistory:
    def __init__(self, device, seats: int = 64, capacity: int = CAPACITY):
        self.device, self.capacity, self.seats = torch.device(device), capacity, seats
        self.table = torch.full((seats + 1, capacity), -1, dtype=torch.int64, device=self.device)
        self._seat: dict[str, int] = {}
        self._count: dict[str, int] = {}  # tokens the seat's row holds, by request

    def assign(self, request_ids: list[str], tokens: list[list[int]], pending: list[bool] | None = None) -> np.ndarray:
        """The step's seats [R] (host, int64), after freeing the seats of requests not in it and writing
        the rows whose device copy is not current. pending[i]: row i has one more token than `tokens[i]`,
        recorded on the device by a step the host has not read (its seat's row is current)."""
        live = set(request_ids)
        for rid in [r for r in self._seat if r not in live]:
            del self._seat[rid], self._count[rid]
        free = sorted(set(range(self.seats)) - set(self._seat.values()))
        seats = []
        for rid, toks, extra in zip(request_ids, tokens, pending or [False] * len(tokens)):
            count = len(toks) + extra
            if count > self.capacity:
                raise ValueError(f"{rid}: {count} generated tokens exceed the history's {self.capacity}")
            if rid not in self._seat:
                if not free:
                    free = list(range(self.seats, 2 * self.seats))
                    self._grow()
                self._seat[rid], self._count[rid] = free.pop(0), -1
            if self._count[rid] != count and count:  # (a row's tokens beyond its count are never read)
                if extra:
                    raise ValueError(f"{rid}: a pending token, but its seat's row is not current")
                self._write_row(self._seat[rid], toks)
            self._count[rid] = count + 1  # after this step's token is recorded
            seats.append(self._seat[rid])
        return np.array(seats, dtype=np.int64)

    def rows(self, seats: Tensor, counts: Tensor) -> Tensor:
        """[R, capacity]: each row's generated tokens, -1 beyond its count."""
        rows = self.table.index_select(0, seats)
        beyond = torch.arange(self.capacity, device=self.device).unsqueeze(0) >= counts.unsqueeze(1)
        return rows.masked_fill(beyond, -1)

    def record(self, seats: Tensor, counts: Tensor, tokens: Tensor) -> None:
        """Each row's new token at its position (count)."""
        self.table[seats, counts.clamp(max=self.capacity - 1)] = tokens.to(torch.int64)

    def _write_row(self, seat: int, tokens: list[int]) -> None:
        row = torch.full((self.capacity,), -1, dtype=torch.int64)
        row[: len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        self.table[seat].copy_(row)

    @property
    def scratch_seat(self) -> int:
        return self.seats

    def _grow(self) -> None:
        """Twice the seats (a new table: a static step captured over the old one no longer applies)."""
        table = torch.full((2 * self.seats + 1, self.capacity), -1, dtype=torch.int64, device=self.device)
        table[: self.seats].copy_(self.table[: self.seats])
        self.table, self.seats = table, 2 * self.seats

    def __len__(self) -> int:
        return len(self._seat)


def last_tokens(history: Tensor, counts: Tensor, n: int, first: int = 0) -> Tensor:
    """[R, n]: each row's last n tokens of `history` (rows as `TokenHistory.rows` gives them),
    right-aligned; -1 where the row has fewer, or where the position is below `first`."""
    index = counts.unsqueeze(1) - n + torch.arange(n, device=history.device)
    taken = history.gather(1, index.clamp(min=0, max=history.shape[1] - 1))
    return torch.where(index >= max(first, 0), taken, -1)
