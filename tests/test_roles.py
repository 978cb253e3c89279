"""gradflow.roles: the codes are a fixed contract (``prompt`` is 7, after ``relpos``), names and codes round-trip
for every code, and the one display order keeps ``prompt`` beside ``context``."""

from __future__ import annotations

import pytest
import torch

from gradflow.roles import (ALL_ROLES, LOSS_ROLES, NUM_ROLES, ROLE_ORDER, TOKEN_ROLES, Role, loss_position_mask,
                            role_code, role_counts, role_name)

CODES = {"masked": 0, "random": 1, "kept": 2, "context": 3, "special": 4, "pad": 5, "relpos": 6, "prompt": 7}


def test_the_codes_are_the_public_contract():
    assert {role.name.lower(): int(role) for role in Role} == CODES
    assert NUM_ROLES == 8 and ALL_ROLES == tuple(sorted(CODES, key=CODES.get))
    assert ALL_ROLES[7] == "prompt" and ALL_ROLES[Role.RELPOS] == "relpos"


@pytest.mark.parametrize("name, code", CODES.items(), ids=[f"{n} is {c}" for n, c in CODES.items()])
def test_name_and_code_round_trip(name, code):
    assert role_code(name) == code and role_name(code) == name
    assert role_name(torch.tensor(code, dtype=torch.int8)) == name  # a tensor element, as the tables read them
    assert role_name(role_code(name)) == name and role_code(role_name(code)) == code


def test_one_display_order_with_prompt_beside_context():
    assert TOKEN_ROLES == ("masked", "random", "kept", "context", "prompt", "special", "pad")
    assert ROLE_ORDER == (*TOKEN_ROLES, "relpos") and sorted(ROLE_ORDER) == sorted(ALL_ROLES)
    assert "prompt" not in LOSS_ROLES


def test_role_counts_maps_every_token_code_to_its_name():
    codes = [c for c in CODES.values() if c != Role.RELPOS]
    roles = torch.tensor([[code for code in codes for _ in range(code + 1)]], dtype=torch.int8)  # code c: c + 1 times
    counts = role_counts(roles)
    assert list(counts) == list(TOKEN_ROLES)  # display order
    assert counts == {role_name(c): c + 1 for c in codes}  # prompt: 8 positions, pad: 6, ...
    assert role_counts(torch.tensor([[0, 3, 3, 4]], dtype=torch.int8))["prompt"] == 0


def test_unknown_names_and_codes_are_refused():
    with pytest.raises(ValueError, match="unknown role 'question'; roles are masked, random, kept, context, prompt"):
        role_code("question")
    with pytest.raises(IndexError):
        role_name(8)


def test_prompt_positions_carry_no_loss():
    roles = torch.tensor([[Role.SPECIAL, Role.PROMPT, Role.PROMPT, Role.SPECIAL, Role.MASKED, Role.CONTEXT]],
                         dtype=torch.int8)
    assert loss_position_mask(roles).tolist() == [[False, False, False, False, True, False]]
