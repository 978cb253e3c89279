"""Mixtures of experts in a single-run report: ``experts.csv`` and ``router_aux.csv`` as tables and summary sections.

A run of a mixture-of-experts model has ``experts.csv`` (per block, the rows of each role routed to each expert) and,
recorded with ``--router-aux-loss``, ``router_aux.csv`` (per block, each router's and experts weight's gradient norm
from the recorded loss alone and from the auxiliary router loss term alone). :func:`moe_tables` derives the report's
``tables/expert_roles.csv``, ``expert_rows.csv`` and ``router_aux_ratio.csv`` from them and from ``sublayers.csv``
(the experts weights' split by role, ``<experts>.<weight>``); :func:`moe_section` writes the ``summary.md`` sections
"Experts" and "Auxiliary router loss". A dense run has neither file: no table, no section, nothing changes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import pandas as pd

from gradflow.analysis import Run, RunError
from gradflow.figures.tables import TextTable, markdown_table
from gradflow.formatting import MISSING, format_number
from gradflow.schema import (EXPERT_DTYPES, EXPERTS_FILE, LOSS, LOSS_ROLES, REPORT_TABLES, ROUTER_AUX_DTYPES,
                             ROUTER_AUX_FILE, conform, role_rank)

EXPERT_ROLES_TABLE = "expert_roles"
"""Per block, experts module and role: rows routed and the share of the experts' weight-gradient signal."""
EXPERT_ROWS_TABLE = "expert_rows"
"""``experts.csv``'s rows of each role routed to each expert, with the expert's share of the role's rows."""
ROUTER_AUX_TABLE = "router_aux_ratio"
"""``router_aux.csv`` with the ratio ``norm_aux / norm_loss``."""
MOE_TABLES: tuple[str, ...] = (EXPERT_ROLES_TABLE, EXPERT_ROWS_TABLE, ROUTER_AUX_TABLE)
"""The report's tables of mixtures of experts (in :data:`gradflow.schema.REPORT_TABLES`; a dense run has none)."""
ROUTER = "ffn.router"
"""The router's recorded name in gradflow's MoE adapters (``RouterAuxSpec.router``); another router (the generic
adapter's: its path in the block) is named by meta.json's ``routers``."""
PAD = "pad"
PER_EXPERT_LIMIT = 64
"""Most (block, expert) rows the summary's per-expert table lists; beyond, the last block's experts only."""


# ----------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------

def moe_tables(run: Run) -> dict[str, pd.DataFrame]:
    """The report's mixture-of-experts tables of ``run``: ``expert_roles`` and ``expert_rows`` with ``experts.csv``,
    ``router_aux_ratio`` with ``router_aux.csv``; none for a dense run. A malformed file raises :class:`RunError`."""
    experts = read_optional(run, EXPERTS_FILE, EXPERT_DTYPES)
    aux = read_optional(run, ROUTER_AUX_FILE, ROUTER_AUX_DTYPES)
    tables: dict[str, pd.DataFrame] = {}
    if experts is not None:
        tables[EXPERT_ROLES_TABLE] = expert_roles(experts, run.sublayers)
        tables[EXPERT_ROWS_TABLE] = expert_rows(experts)
    if aux is not None:
        ratio = aux.assign(aux_ratio=aux["norm_aux"] / aux["norm_loss"].where(aux["norm_loss"] > 0))
        tables[ROUTER_AUX_TABLE] = conform(ratio, REPORT_TABLES[ROUTER_AUX_TABLE], ROUTER_AUX_TABLE)
    return tables


def read_optional(run: Run, file: str, dtypes: Mapping[str, str]) -> pd.DataFrame | None:
    """The run's optional table ``file`` with the schema's columns (None when absent)."""
    path = run.path / file
    if not path.is_file():
        return None
    frame = pd.read_csv(path, dtype={c: str for c, d in dtypes.items() if d == "str"})
    missing = [c for c in dtypes if c not in frame.columns]
    if missing:
        raise RunError(f"{str(path)!r} lacks the column(s) {', '.join(missing)} of gradflow.schema: it was not written "
                       "by this gradflow's record. Record the run again, or remove the file to report without it.")
    return frame.astype({c: "int64" for c, d in dtypes.items() if d == "int64"})[list(dtypes)]


def expert_roles(experts: pd.DataFrame, sublayers: pd.DataFrame) -> pd.DataFrame:
    """Per (layer, experts module, role but pad, and the pooled ``loss``): the rows routed to the module and their
    share, the summed per-position magnitudes over the module's weights (sublayers.csv's ``<experts>.*``, param
    ``weight``) and their share; ``exact_zero``: that sum is exactly 0.0."""
    weights = sublayers[sublayers["param"] == "weight"]
    rows = []
    for (layer, module), routed in experts[experts["role"] != PAD].groupby(["layer", "experts"], sort=True):
        n_rows = routed.groupby("role")["n_rows"].sum()
        mine = weights[(weights["layer"] == layer) & weights["sublayer"].str.startswith(f"{module}.")]
        magnitude = mine[mine["role"] != PAD].groupby("role")["magnitude_sum"].sum()
        roles = sorted(set(n_rows[n_rows > 0].index) | set(magnitude.index), key=role_rank)
        total_rows, total = int(n_rows.sum()), float(magnitude.sum())
        loss = [r for r in LOSS_ROLES if r in magnitude.index]
        for role, count, mag in [*((r, n_rows.get(r, 0), magnitude.get(r, math.nan)) for r in roles),
                                 (LOSS, n_rows.reindex(LOSS_ROLES, fill_value=0).sum(),
                                  float(magnitude[loss].sum()) if loss else math.nan)]:
            rows.append({"layer": int(layer), "experts": module, "role": role, "n_rows": int(count),
                         "row_share": count / total_rows if total_rows else math.nan, "magnitude_sum": float(mag),
                         "share": mag / total if total > 0 else math.nan, "exact_zero": bool(mag == 0.0)})
    return conform(pd.DataFrame(rows), REPORT_TABLES[EXPERT_ROLES_TABLE], EXPERT_ROLES_TABLE)


def expert_rows(experts: pd.DataFrame) -> pd.DataFrame:
    """``experts.csv`` as written (every role, pad included) with ``expert_share``: the expert's share of the role's
    rows in its block's experts module (NaN where the role has none)."""
    totals = experts.groupby(["layer", "experts", "role"])["n_rows"].transform("sum")
    out = experts.assign(expert_share=experts["n_rows"] / totals.where(totals > 0))
    return conform(out.reset_index(drop=True), REPORT_TABLES[EXPERT_ROWS_TABLE], EXPERT_ROWS_TABLE)


# ----------------------------------------------------------------------------------------------
# summary.md
# ----------------------------------------------------------------------------------------------

def moe_section(run: Run, tables: Mapping[str, pd.DataFrame]) -> list[str]:
    """Lines of ``summary.md``'s "Experts" (with ``experts.csv``) and "Auxiliary router loss" (with
    ``router_aux.csv``) sections; none for a dense run."""
    lines: list[str] = []
    if EXPERT_ROLES_TABLE in tables:
        lines += _experts_section(run, tables[EXPERT_ROLES_TABLE], tables[EXPERT_ROWS_TABLE],
                                  tables.get(ROUTER_AUX_TABLE))
    if ROUTER_AUX_TABLE in tables:
        modules = tables[EXPERT_ROLES_TABLE]["experts"].unique() if EXPERT_ROLES_TABLE in tables else []
        lines += _aux_section(run, tables[ROUTER_AUX_TABLE], list(modules))
    return lines


def _percent(x: float) -> str:
    """A share as a percentage; an exact zero ``0``, NaN ``–``."""
    return MISSING if pd.isna(x) else "0" if x == 0 else f"{format_number(100 * float(x))}%"


def _experts_section(run: Run, roles: pd.DataFrame, per_expert: pd.DataFrame, aux: pd.DataFrame | None) -> list[str]:
    modules = list(roles["experts"].unique())
    weights = sorted({s for m in modules for s in run.sublayers["sublayer"].unique() if s.startswith(f"{m}.")})
    pads = int(per_expert.loc[per_expert["role"] == PAD, "n_rows"].sum())
    lines = ["## Experts (mixture of experts)", "",
             "Each mixture-of-experts block routes a position's row to k of its experts (a position routed to k "
             "experts is one row of each); an expert's weight gradient is a sum over the rows routed to it, split by "
             "the role of the position each row came from. Per block: each role's share of the rows routed to the "
             f"experts module ({', '.join(f'`{m}`' for m in modules)}; experts.csv, summed over batches"
             + (f"; its pad rows, {pads} over all blocks, left out as in sublayers.csv" if pads else "")
             + ") and of its weight-gradient signal (the summed per-position magnitudes ‖g_t‖ ‖x_t‖ of "
             f"sublayers.csv, summed over the module's weights {', '.join(f'`{w}`' for w in weights) or MISSING}); "
             "`loss` pools masked, random and kept; 0 is exactly zero (tables/expert_roles.csv). Under top-k routing "
             "every position is k rows in every block, so the rows' shares are the positions'; the signal's differ.",
             ""]
    lines += markdown_table(_roles_table(roles, len(modules) > 1)) + [""]
    lines += _last_block(run, modules, weights, roles, aux)
    return lines + _per_expert(per_expert)


def _roles_table(roles: pd.DataFrame, with_module: bool) -> TextTable:
    """One row per block (and experts module): the rows' and the signal's share of ``loss`` and each other role."""
    shown = [LOSS, *sorted((r for r in roles["role"].unique() if r != LOSS and r not in LOSS_ROLES), key=role_rank)]
    header = ["layer", *(["experts"] if with_module else []), *(f"rows: {r}" for r in shown),
              *(f"signal: {r}" for r in shown)]
    rows = []
    for (layer, module), group in roles.groupby(["layer", "experts"], sort=True):
        by_role = group.set_index("role")
        cells = [_percent(by_role["row_share"].get(r, math.nan)) for r in shown]
        cells += [_percent(by_role["share"].get(r, math.nan)) for r in shown]
        rows.append((int(layer), *([module] if with_module else []), *cells))
    return TextTable(tuple(header), tuple(rows))


def _routers(run: Run, modules: Sequence[str], layer: int, aux: pd.DataFrame | None) -> list[str]:
    """The router sublayers recorded at ``layer``: ``ffn.router``, those meta.json names (``routers``: the generic
    adapter's, by module path) and any other one router_aux.csv names."""
    names = {ROUTER} | set(run.meta.get("routers", ())) | (
        {s for s in aux["sublayer"] if not any(s.startswith(f"{m}.") for m in modules)} if aux is not None else set())
    present = run.sublayers.loc[run.sublayers["layer"] == layer, "sublayer"].unique()
    return sorted(s for s in names if s in present)


def _last_block(run: Run, modules: Sequence[str], weights: Sequence[str], roles: pd.DataFrame,
                aux: pd.DataFrame | None) -> list[str]:
    """The last block's experts weights and router: what the positions without a loss send them."""
    layer = run.num_layers
    if layer not in set(roles["layer"]):
        return [f"The last block (layer {layer}) has no experts: the exact zero after the last attention is not "
                "theirs to show.", ""]
    names = [*_routers(run, modules, layer, aux), *weights]
    table = run.sublayers[(run.sublayers["layer"] == layer) & (run.sublayers["param"] == "weight")
                          & run.sublayers["sublayer"].isin(names) & ~run.sublayers["role"].isin([*LOSS_ROLES, PAD])]
    if table.empty:
        return [f"sublayers.csv has no split of the last block's (layer {layer}) experts weights.", ""]
    table = table.assign(_s=table["sublayer"].map(names.index), _r=table["role"].map(role_rank))
    table = table.sort_values(["_s", "_r"])
    context = table[table["role"] == "context"]
    zero = [s for s, m, g in zip(context["sublayer"], context["magnitude_sum"], context["contribution_norm_mean"])
            if m == 0.0 and g == 0.0]
    rest = context[~context["sublayer"].isin(zero)]
    lines = [f"### Last block (layer {layer}): the experts and the router from positions without a loss", ""]
    if zero:
        lines += [f"Context positions send exactly 0 (0.0 in sublayers.csv) to {', '.join(f'`{s}`' for s in zero)}"
                  ": after the last attention a position's row reaches only its own output, which has no loss at a "
                  "context position, so these rows carry exactly zero gradient.", ""]
    aux = "router_aux_loss" in run.meta
    for sub, share in zip(rest["sublayer"], rest["share"]):
        why = (" This run's split includes the auxiliary router loss (`--router-aux-loss`), whose gradient reaches "
               "the router's logits at every position (Auxiliary router loss, below)." if aux and sub not in weights
               else " Not the exact zero expected after the last attention: check the adapter (`gradflow check`).")
        lines += [f"`{sub}` gets {_percent(share)} of its signal from context positions.{why}", ""]
    exact = "exactly 0"
    rows = tuple((s, r, exact if m == 0.0 else _percent(sh), exact if g == 0.0 else format_number(g))
                 for s, r, m, sh, g in zip(table["sublayer"], table["role"], table["magnitude_sum"], table["share"],
                                           table["contribution_norm_mean"]))
    header = ("sublayer", "role", "share of the signal", "‖G_role‖ (batch mean)")
    return [*lines, "Each role without a loss: its share of the sublayer's signal and the norm of its contribution "
            "to the weight gradient (sublayers.csv's `share` and `contribution_norm_mean`).", "",
            *markdown_table(TextTable(header, rows)), ""]


def _per_expert(per_expert: pd.DataFrame) -> list[str]:
    """The rows of each role routed to each expert (every block's, or the last block's when they are many)."""
    groups = per_expert[["layer", "experts", "expert"]].drop_duplicates()
    last = int(per_expert["layer"].max())
    table = per_expert if len(groups) <= PER_EXPERT_LIMIT else per_expert[per_expert["layer"] == last]
    wide = table.pivot_table(index=["layer", "experts", "expert"], columns="role", values="n_rows", aggfunc="sum",
                             fill_value=0)
    shown = sorted((r for r in wide.columns if wide[r].sum() > 0), key=role_rank)
    with_module = per_expert["experts"].nunique() > 1
    header = ("layer", *(["experts"] if with_module else []), "expert", *shown, "all")
    rows = tuple((layer, *([module] if with_module else []), expert, *(int(row[r]) for r in shown),
                  int(row.sum())) for (layer, module, expert), row in wide.iterrows())
    scope = ("" if table is per_expert else
             f" The last block's experts only ({len(groups)} (block, expert) pairs in all: tables/expert_rows.csv).")
    return ["### Rows routed to each expert, by role", "",
            "Rows of each role routed to each expert, summed over batches (experts.csv; tables/expert_rows.csv adds "
            "each expert's share of the role's rows); all: the expert's rows." + scope, "",
            *markdown_table(TextTable(header, rows)), ""]


def _aux_section(run: Run, aux: pd.DataFrame, modules: Sequence[str]) -> list[str]:
    """Per block, the router's and each experts weight's gradient norm from the auxiliary term against the loss's."""
    meta = run.meta.get("router_aux_loss") or {}
    coef, term = meta.get("coefficient"), meta.get("mean_term")
    lines = ["## Auxiliary router loss", "",
             "Recorded with `--router-aux-loss`: the model's auxiliary router loss (load balancing) times its "
             f"coefficient {format_number(coef)} was added to the loss (the term added: {format_number(term)} on "
             "average per batch; meta.json's `router_aux_loss`). Per block, the Frobenius norm of the router's and "
             "each experts weight's gradient from the recorded loss alone (`norm_loss`) and from the term alone "
             "(`norm_aux`), each a mean over batches (router_aux.csv), and aux / loss their ratio (the two gradients "
             "add as vectors: their norms are no shares of one total; tables/router_aux_ratio.csv). The term reads "
             "every position's router logits (pad excluded by the attention mask), so it reaches the last block's "
             "router from every position: that router's exact zero from context positions holds under the loss "
             "alone, not with the term included (and this run's split in sublayers.csv includes it)."]
    layer = run.num_layers
    last = aux[(aux["layer"] == layer) & aux["sublayer"].map(lambda s: any(s.startswith(f"{m}.") for m in modules))]
    if len(last) and (last["norm_aux"] == 0.0).all():
        lines[-1] += (f" The last block's experts get exactly 0 from the term (norm_aux 0.0 for "
                      f"{', '.join(f'`{s}`' for s in last['sublayer'])}): nothing it reads comes after them.")
    rows = tuple((int(r.layer), r.sublayer + ("" if r.param == "weight" else f" ({r.param})"),
                  format_number(r.norm_loss), format_number(r.norm_aux), format_number(r.aux_ratio))
                 for r in aux.itertuples(index=False))
    header = ("layer", "sublayer", "from the loss", "from the aux term", "aux / loss")
    return [*lines, "", *markdown_table(TextTable(header, rows)), ""]


__all__ = ["EXPERT_ROLES_TABLE", "EXPERT_ROWS_TABLE", "MOE_TABLES", "PER_EXPERT_LIMIT", "ROUTER", "ROUTER_AUX_TABLE",
           "expert_roles", "expert_rows", "moe_section", "moe_tables", "read_optional"]
