"""Position roles: the names and integer codes used everywhere in gradflow.

A role says what the MLM objective does with a position:

========  ====  ==============================================================
name      code  meaning
========  ====  ==============================================================
masked    0     selected for the loss, input replaced by the mask token
random    1     selected for the loss, input replaced by a random token
kept      2     selected for the loss, input left unchanged
context   3     not selected: a clean channel that carries no loss
prompt    7     a supervised fine-tuning prompt's token: never selected, carries no loss (a clean
                channel, like context)
special   4     [CLS], [SEP], <s>, </s>, ... (never selected)
pad       5     padding (never selected, masked out of attention)
========  ====  ==============================================================

Loss positions are ``masked + random + kept``. Sublayer tables may add the pseudo-role ``relpos``
(code 6), for weight-gradient contributions that come from a non-token input such as DeBERTa's
relative-position embeddings passing through a shared query/key projection.

The codes are a public contract and never change: ``prompt`` came after ``relpos`` and has code 7,
so token codes are not contiguous. Two orders follow: :data:`ALL_ROLES` is indexed by code
(``ALL_ROLES[code]``, what :func:`role_name` reads), and :data:`ROLE_ORDER` (:data:`TOKEN_ROLES` then
``relpos``) is the one display order of every table, figure and the explorer: ``prompt`` beside
``context``. Outside supervised fine-tuning no position is ``prompt``; in it, ``context`` is the
response's clean tokens.
"""

from __future__ import annotations

from enum import IntEnum

import torch


class Role(IntEnum):
    """Integer code of each position role (stored as int8 tensors of shape (B, T))."""

    MASKED = 0
    RANDOM = 1
    KEPT = 2
    CONTEXT = 3
    SPECIAL = 4
    PAD = 5
    RELPOS = 6
    PROMPT = 7


ALL_ROLES: tuple[str, ...] = tuple(role.name.lower() for role in sorted(Role))
"""Every role name indexed by its code: ``ALL_ROLES[code]`` (``relpos`` at 6, ``prompt`` at 7)."""
TOKEN_ROLES: tuple[str, ...] = ("masked", "random", "kept", "context", "prompt", "special", "pad")
"""The roles of token positions, in display order (not indexed by code: use :func:`role_name`)."""
ROLE_ORDER: tuple[str, ...] = (*TOKEN_ROLES, "relpos")
"""Every role in display order: the order of every table's rows, every figure and the explorer."""
LOSS_ROLES: tuple[str, ...] = ("masked", "random", "kept")
NUM_ROLES = len(ALL_ROLES)
"""The number of role codes (0 .. NUM_ROLES - 1): the length of every per-role array indexed by code."""


def role_name(code: int) -> str:
    """Name of a role code, e.g. ``role_name(3) == "context"``, ``role_name(7) == "prompt"``."""
    return ALL_ROLES[int(code)]


def role_code(name: str) -> int:
    """Code of a role name; raises ``ValueError`` naming the valid roles."""
    try:
        return ALL_ROLES.index(name)
    except ValueError:
        raise ValueError(f"unknown role {name!r}; roles are {', '.join(ROLE_ORDER)}") from None


def loss_position_mask(roles: torch.Tensor) -> torch.Tensor:
    """Boolean mask (same shape as ``roles``) of the positions that carry the MLM loss."""
    return roles <= Role.KEPT


def role_counts(roles: torch.Tensor) -> dict[str, int]:
    """Number of positions of each token role in a (B, T) role tensor, in :data:`TOKEN_ROLES` order."""
    counts = torch.bincount(roles.reshape(-1).long().cpu(), minlength=NUM_ROLES)
    return {name: int(counts[role_code(name)]) for name in TOKEN_ROLES}
