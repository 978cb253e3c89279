"""The input side of a Linear call's per-role statistics, computed once for every module that reads it.

BERT's query, key and value projections (and any Linears fed the same hidden state) read one input.
What the per-role split needs from it does not depend on the module: the rows' norms, which rows
have a nonzero element, the rows of the small roles gathered in role order, each role's Gram matrix
``X_r X_r^T`` and the largest role's rows for the weight gradient's backward
(:mod:`gradflow.hooks.split_linear`). :class:`InputRows` computes each lazily, once; the recorder
keeps the last one in a single slot of :class:`~gradflow.hooks.batch_state.BatchState` and drops it
with the batch, so at most one input outlives its call, and only until the next Linear input.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from gradflow.hooks.safe_norms import flag_unsafe, safe_norm
from gradflow.roles import NUM_ROLES


def float32(values: torch.Tensor) -> torch.Tensor:
    """``values`` as float32 (itself when it already is: no dispatch for the common case)."""
    return values if values.dtype == torch.float32 else values.float()


@dataclass(frozen=True)
class RestRows:
    """The rows of every role but ``big``, ordered by role (smallest role first): ``index`` (n_rest,) into
    the call's rows, ``starts`` the first row of each role in that order, ``native`` (n_rest, D_in) the rows
    in the input's own dtype (a role's float32 copy is made only when its statistics need it:
    :meth:`InputRows.role_rows`)."""

    index: torch.Tensor
    starts: dict[int, int]
    native: torch.Tensor


@dataclass
class InputRows:
    """The input side of one Linear input ``source`` (..., D_in), as rows ``x2`` (N, D_in), under a role
    partition of its N rows.

    ``xn`` (N,) float32: safe row norms (of a bfloat16 input on a CPU, its own reduction: see
    :func:`~gradflow.hooks.safe_norms.safe_norm`'s ``native``); ``nonzero`` (N,) bool: rows with a nonzero
    element; ``unsafe`` (N,) bool: rows whose norm is nonzero and outside the safe range (see
    :func:`~gradflow.hooks.safe_norms.flag_unsafe`)."""

    source: torch.Tensor
    x2: torch.Tensor
    codes: torch.Tensor
    index: list[torch.Tensor]
    counts: tuple[int, ...]
    xn: torch.Tensor
    nonzero: torch.Tensor
    unsafe: torch.Tensor
    _rest: dict[int, RestRows] = field(default_factory=dict)
    _gram: dict[int, torch.Tensor] = field(default_factory=dict)
    _big: dict[int, torch.Tensor] = field(default_factory=dict)
    _float: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, x: torch.Tensor, codes: torch.Tensor, index: list[torch.Tensor], counts: tuple[int, ...]
           ) -> "InputRows":
        """The input side of ``x`` (..., D_in), whose B * T (or N) rows have role ``codes`` (N,)."""
        x2 = x.reshape(-1, x.shape[-1])
        xn = safe_norm(x2, dim=-1, native=True)
        return cls(x, x2, codes, index, counts, xn, xn > 0, flag_unsafe(xn))

    def rest(self, big: int) -> RestRows:
        """The rows of every role but ``big``, gathered once."""
        if big not in self._rest:
            order = sorted((code for code in range(NUM_ROLES) if code != big and self.counts[code]),
                           key=self.counts.__getitem__)
            index = torch.cat([self.index[code] for code in order]) if order else self.index[big][:0]
            starts = dict(zip(order, itertools.accumulate([self.counts[code] for code in order], initial=0)))
            native = self.x2.index_select(0, index)
            self._rest[big] = RestRows(index, starts, native)
        return self._rest[big]

    def role_rows(self, code: int, big: int, native: bool = False) -> torch.Tensor:
        """(n_r, D_in) float32 (``native``: in the input's own dtype): the rows of role ``code`` in index order
        (a float32 copy of a low-precision input's rows made once per role, only for the roles asked for: the
        roles without a nonzero contribution, most rows in a model's last block, are never converted)."""
        if code == big:
            return self.big_rows(big) if native else float32(self.big_rows(big))
        rest = self.rest(big)
        rows = rest.native[rest.starts[code]: rest.starts[code] + self.counts[code]]
        if native or rows.dtype == torch.float32:
            return rows
        if (code, big) not in self._float:
            self._float[(code, big)] = rows.float()
        return self._float[(code, big)]

    def gram(self, code: int, big: int) -> torch.Tensor:
        """(n_r, n_r) float32 Gram matrix ``X_r X_r^T`` of role ``code``'s rows."""
        if code not in self._gram:
            rows = self.role_rows(code, big)
            self._gram[code] = rows @ rows.T
        return self._gram[code]

    def big_rows(self, big: int) -> torch.Tensor:
        """(n_big, D_in) role ``big``'s rows in the input's own dtype, gathered once (the backward's product)."""
        if big not in self._big:
            self._big[big] = self.x2.index_select(0, self.index[big])
        return self._big[big]


@dataclass
class InputSlot:
    """The last :class:`InputRows` computed, and what identifies its input: the same storage, shape,
    strides, dtype and version (no in-place change since), under the same partition object."""

    key: tuple | None = None
    rows: InputRows | None = None

    def get(self, x: torch.Tensor, codes: torch.Tensor, index: list[torch.Tensor], counts: tuple[int, ...]
            ) -> InputRows:
        """The input side of ``x`` (computed now unless the last input was the same)."""
        key = (x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, x.device, x._version, id(codes))
        if self.rows is None or key != self.key or self.rows.codes is not codes:
            self.rows = InputRows.of(x, codes, index, counts)  # holds x (and codes): the key's ids stay unique
            self.key = key
        return self.rows

    def clear(self) -> None:
        """Drop the input (end of the batch)."""
        self.key, self.rows = None, None


__all__ = ["InputRows", "InputSlot", "RestRows", "float32"]
