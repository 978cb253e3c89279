"""Position roles: the names and integer codes used everywhere in gradflow.

A role says what the MLM objective does with a position:

========  ====  ==============================================================
name      code  meaning
========  ====  ==============================================================
masked    0     selected for the loss, input replaced by the mask token
random    1     selected for the loss, input replaced by a random token
kept      2     selected for the loss, input left unchanged
context   3     not selected: a clean channel that carries no loss
special   4     [CLS], [SEP], <s>, </s>, ... (never selected)
pad       5     padding (never selected, masked out of attention)
========  ====  ==============================================================

Loss positions are ``masked + random + kept``. Sublayer tables may add a seventh pseudo-role,
``relpos`` (code 6), for weight-gradient contributions that come from a non-token input such as
DeBERTa's relative-position embeddings passing through a shared query/key projection.
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


TOKEN_ROLES: tuple[str, ...] = ("masked", "random", "kept", "context", "special", "pad")
ALL_ROLES: tuple[str, ...] = (*TOKEN_ROLES, "relpos")
LOSS_ROLES: tuple[str, ...] = ("masked", "random", "kept")
NUM_ROLES = len(ALL_ROLES)


def role_name(code: int) -> str:
    """Name of a role code, e.g. ``role_name(3) == "context"``."""
    return ALL_ROLES[int(code)]


def role_code(name: str) -> int:
    """Code of a role name; raises ``ValueError`` naming the valid roles."""
    try:
        return ALL_ROLES.index(name)
    except ValueError:
        raise ValueError(f"unknown role {name!r}; roles are {', '.join(ALL_ROLES)}") from None


def loss_position_mask(roles: torch.Tensor) -> torch.Tensor:
    """Boolean mask (same shape as ``roles``) of the positions that carry the MLM loss."""
    return roles <= Role.KEPT


def role_counts(roles: torch.Tensor) -> dict[str, int]:
    """Number of positions of each token role in a (B, T) role tensor."""
    counts = torch.bincount(roles.reshape(-1).long().cpu(), minlength=len(TOKEN_ROLES))
    return {name: int(counts[i]) for i, name in enumerate(TOKEN_ROLES)}
