"""The citable findings (issue 49, points 4 and 5): every number and interval of the findings table in
docs/results/index.md, and of its copies in README.md and docs/index.md, is read from the committed
table it names and compared at the precision printed; the copies agree with the index row for row; each
row's make target exists and its minutes agree with the Reproduce index (analyses/README.md), which has
a network column for every target. Point 5: README.md and docs/index.md say at the top how to read the
docs, and every include and image path of a raw docs page names a committed file.

A printed integer (``0``, ``8``) must equal the committed value exactly; a printed decimal must be within
half a unit of its last digit of the committed value, read at full precision from the CSV."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
INDEX = ROOT / "docs" / "results" / "index.md"
COPIES = [ROOT / "README.md", ROOT / "docs" / "index.md"]
REPRODUCE = ROOT / "analyses" / "README.md"
MAKEFILE = ROOT / "analyses" / "Makefile"
FIG = ROOT / "figures"
NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)?")
CHECKPOINT_SUBLAYERS = ["attn.q", "attn.out", "attn.norm", "ffn.in", "ffn.out", "ffn.norm"]


# ---------------------------------------------------------------------- reading the pages
def findings(path: Path) -> dict[int, dict[str, str]]:
    """The rows of the page's findings table (header ``| # | claim | number | 95% CI | ...``), by row number."""
    rows, header = {}, None
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:4] == ["#", "claim", "number", "95% CI"]:
            header = cells
        elif header and not set(line) <= set("|-: "):
            assert len(cells) == len(header), f"{path.name}: a row with {len(cells)} cells: {line[:80]}"
            rows[int(cells[0])] = dict(zip(header, cells))
    assert rows, f"{path}: no findings table (header | # | claim | number | 95% CI | ...)"
    return rows


def printed(cell: str) -> list[str]:
    """The numbers of a number or CI cell, as printed."""
    return NUMBER.findall(cell)


def disagreements(cell: str, values: list[float]) -> list[str]:
    """The printed numbers of ``cell`` that do not match ``values`` (one per printed number, in order)."""
    numbers = printed(cell)
    if len(numbers) != len(values):
        return [f"{cell!r} prints {len(numbers)} numbers, the committed tables give {len(values)}: {values}"]
    out = []
    for text, value in zip(numbers, values):
        decimals = len(text.split(".")[1]) if "." in text else 0
        ok = float(text) == value if decimals == 0 else abs(float(text) - value) <= 0.5 * 10.0 ** -decimals + 1e-12
        if not ok:
            out.append(f"{text} in {cell!r}: committed {value:.6g}")
    return out


# ---------------------------------------------------------------------- the committed values, row by row
def _csv(path: str) -> pd.DataFrame:
    return pd.read_csv(FIG / path)


def _estimates(frame: pd.DataFrame, value: str = "mean", low: str = "ci_low", high: str = "ci_high"):
    """(numbers, interval ends) of the frame's rows, in row order."""
    assert len(frame) >= 1
    return list(frame[value]), [x for _, r in frame.iterrows() for x in (r[low], r[high])]


def _one(frame: pd.DataFrame, **where) -> pd.DataFrame:
    for column, value in where.items():
        frame = frame[frame[column] == value]
    assert len(frame) == 1, where
    return frame


def exact_zero():
    frames = [_csv("atlas/atlas.csv"), _csv("twelve-blocks/atlas/atlas.csv")]
    atlas = pd.concat(frames).drop_duplicates(["model", "depth_fraction", "metric"])
    last = atlas[atlas["depth_fraction"] == 1.0]
    share = {m: g.set_index("metric")["value"] for m, g in last.groupby("model")}
    disagree = atlas[atlas["metric"] == "theory_disagreements"].groupby("model")["value"].max()
    zero = [m for m, s in share.items()
            if all(s[f"context_share:{x}"] == 0.0 for x in CHECKPOINT_SUBLAYERS)
            and s["context_share:attn.k"] > 0 and s["context_share:attn.v"] > 0 and disagree[m] == 0]
    largest = max(s[f"context_share:{x}"] for s in share.values() for x in CHECKPOINT_SUBLAYERS)
    return [largest, len(zero), atlas["model"].nunique()], []


def context_ratio():
    ratios = _csv("report/compare_models/tables/ratios.csv")
    ratios = ratios[(ratios["label"] == "mini-en, MLM loss") & (ratios["role"] == "context")].set_index("layer")
    last = ratios.loc[6]
    assert last["ratio"] == last["ci_low"] == last["ci_high"] == 0.0  # "exact": the interval is [0, 0] too
    return [ratios.loc[0, "ratio"], ratios.loc[5, "ratio"], last["ratio"]], \
        [ratios.loc[0, "ci_low"], ratios.loc[0, "ci_high"], ratios.loc[5, "ci_low"], ratios.loc[5, "ci_high"]]


def pressure(model: str):
    def read():
        table = _csv("pressure/pressure.csv")
        table = table[(table["model"] == model) & table["last_block"]].set_index("sublayer").loc[["attn.q", "ffn.in"]]
        return _estimates(table, "pressure")
    return read


def robustness(path: str, model: str):
    def read():
        table = _csv(path)
        rows = [_one(table, model=model, task="brown-pos", family=f, train_size=4500) for f in ("logistic", "mlp")]
        return _estimates(pd.concat(rows), "last_layer_drop")
    return read


def probe_drop():
    table = _csv("probes/n1500/probe_drops_compared.csv")
    return _estimates(_one(table, label="mini-en", task="brown-pos", metric="accuracy"), "last_layer_drop")


def probe_difference():
    table = _csv("probes/n1500/probe_drop_differences.csv")
    return _estimates(_one(table, task="brown-pos", label="twin", baseline="mini-en", metric="accuracy"), "difference")


def contrasts(path: str, *rows: tuple[str, str]):
    def read():
        table = _csv(path)
        if "regime" in table:
            table = table[table["regime"] == "convergence"]
        return _estimates(pd.concat([_one(table, contrast=c, task=t) for c, t in rows]))
    return read


SIX, TWELVE = "finetune/last-block-finetuning/contrasts.csv", "twelve-blocks/finetune/contrasts.csv"
OBJECTIVES, SEED_REGIME = "objectives/finetune/family_a.csv", "objectives/finetune/family_b.csv"
EXPECTED: dict[int, Callable[[], tuple[list[float], list[float]]]] = {
    1: exact_zero,
    2: context_ratio,
    3: pressure("mini-en"),
    4: pressure("twin"),
    5: probe_drop,
    6: robustness("probes/robustness/last_layer_drops.csv", "mini-en"),
    7: probe_difference,
    8: contrasts(SIX, ("mini-en repair1 - full", "brown-pos"), ("mini-en repair1 - full", "brown-propn")),
    9: contrasts(SIX, ("mini-en drop1 - full", "brown-pos")),
    10: contrasts(SIX, ("(mini-en drop1 - full) - (twin drop1 - full)", "brown-pos")),
    11: contrasts(TWELVE, ("mini12-en drop1 - full", "brown-pos")),
    12: contrasts(TWELVE, ("mini12-en repair1 - full", "brown-pos")),
    13: contrasts(TWELVE, ("mini12-en reinit1 - full", "brown-pos"), ("mini12-en reinit1 - full", "brown-propn")),
    14: robustness("twelve-blocks/probes/robustness/last_layer_drops.csv", "mini12-en"),
    15: contrasts(OBJECTIVES, ("mini-en-mask40 drop1 - full", "brown-pos"), ("mini-en-mask40 drop1 - full", "brown-propn")),
    16: contrasts(SEED_REGIME, ("mini-en drop1 - full", "brown-pos")),
    17: contrasts(OBJECTIVES, ("mini-en-diffusion drop1 - full", "brown-pos"),
                  ("mini-en-diffusion reinit1 - full", "brown-pos"), ("mini-en-diffusion repair1 - full", "brown-pos")),
    18: contrasts(SEED_REGIME, ("mini-en-diffusion reinit1 - full", "brown-pos")),
}
# the design of each row: what the plans say (figures/finetune/last-block-finetuning/plan.md, figures/twelve-blocks/plan.md)
DESIGN = {1: "exact", 2: "descriptive", 3: "descriptive", 4: "descriptive", 5: "exploratory", 6: "pre-registered",
          7: "exploratory", **{n: "pre-registered" for n in range(8, 19)}}


# ---------------------------------------------------------------------- the tests
def test_every_row_is_checked():
    assert sorted(findings(INDEX)) == sorted(EXPECTED) == list(range(1, len(EXPECTED) + 1))


@pytest.mark.parametrize("page", [INDEX, *COPIES], ids=lambda p: str(p.relative_to(ROOT)))
def test_numbers_are_the_committed_tables(page):
    wrong = []
    for n, row in findings(page).items():
        numbers, interval = EXPECTED[n]()
        wrong += [f"row {n}: {w}" for w in disagreements(row["number"], numbers)]
        wrong += [f"row {n}: {w}" for w in disagreements(row["95% CI"], interval)]
    assert not wrong, f"{page.name}: numbers that are not the committed tables':\n" + "\n".join(wrong)


@pytest.mark.parametrize("page", COPIES, ids=lambda p: str(p.relative_to(ROOT)))
def test_copies_are_the_index_rows(page):
    index, copy = findings(INDEX), findings(page)
    assert list(copy) == list(range(1, len(copy) + 1)), f"{page.name}: rows 1..N of the index, in order"
    for n, row in copy.items():
        assert row == {k: index[n][k] for k in row}, f"{page.name}, row {n} differs from docs/results/index.md"


def test_the_checker_catches_a_changed_number():
    """The comparison is strict at the printed precision (a test that could not fail would prove nothing)."""
    assert not disagreements("0.472 / 0.287", [0.47239, 0.28738])
    assert disagreements("0.477 / 0.272", [0.47239, 0.28738])  # the atlas's 48-window values are not row 3's
    assert disagreements("0.473", [0.47239])
    assert disagreements("+0.0041", [0.0040])  # one unit of the last digit
    assert not disagreements("+0.0040", [0.00404999])
    assert disagreements("0", [1e-30])  # a printed integer is exact
    assert disagreements("0.1 / 0.2", [0.1])  # a missing number
    numbers, _ = EXPECTED[3]()
    assert disagreements(findings(INDEX)[3]["number"], [numbers[0] + 0.001, numbers[1]])


CONTRASTS = {8: (SIX, [("mini-en repair1 - full", "brown-pos"), ("mini-en repair1 - full", "brown-propn")]),
             9: (SIX, [("mini-en drop1 - full", "brown-pos")]),
             10: (SIX, [("(mini-en drop1 - full) - (twin drop1 - full)", "brown-pos")]),
             11: (TWELVE, [("mini12-en drop1 - full", "brown-pos")]),
             12: (TWELVE, [("mini12-en repair1 - full", "brown-pos")]),
             13: (TWELVE, [("mini12-en reinit1 - full", "brown-pos"), ("mini12-en reinit1 - full", "brown-propn")]),
             15: (OBJECTIVES, [("mini-en-mask40 drop1 - full", "brown-pos"), ("mini-en-mask40 drop1 - full", "brown-propn")]),
             16: (SEED_REGIME, [("mini-en drop1 - full", "brown-pos")])}


def test_design_column():
    """Each row's design is the plans' (pre-registered, exploratory, ...); a contrast row's Holm family is the
    committed table's size, and the significance it states is the committed one."""
    rows = findings(INDEX)
    for n, design in DESIGN.items():
        assert rows[n]["design"].startswith(design), (n, rows[n]["design"])
    for n, (path, contrasts_) in CONTRASTS.items():
        table = _csv(path)
        table = table[table["regime"] == "convergence"] if "regime" in table else table
        design = rows[n]["design"]
        family = len(_csv(path))
        assert f"Holm over {family}" in design, f"row {n}: {path} holds {family} contrasts: {design!r}"
        significant = [bool(_one(table, contrast=c, task=task)["significant"].iloc[0]) for c, task in contrasts_]
        said = "not significant" not in design
        assert "significant)" in design and significant == [said] * len(significant), (n, design, significant)


@pytest.mark.parametrize("path, verdicts", [
    ("probes/robustness/last_layer_drops.md",
     {("mini-en", "brown-pos"): "no drop", ("mini-en", "brown-propn"): "no drop"}),
    ("twelve-blocks/probes/robustness/last_layer_drops.md",
     {("mini12-en", "brown-pos"): "no drop", ("mini12-en", "brown-propn"): "no drop",
      ("twin", "brown-pos"): "gain (last layer best)", ("twin", "brown-propn"): "gain (last layer best)"}),
])
def test_the_rule_verdicts_quoted_in_rows_6_and_14(path, verdicts):
    found = {}
    for line in (FIG / path).read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 4 and cells[2] in ("no drop", "drop", "gain (last layer best)"):
            found[(cells[0], cells[1])] = cells[2]
    assert {k: found.get(k) for k in verdicts} == verdicts


def _reproduce_rows() -> list[dict[str, str]]:
    rows, header = [], None
    for line in REPRODUCE.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| claim, table or figure | make target |"):
            header = cells
        elif header and line.startswith("|") and not set(line) <= set("|-: "):
            rows.append(dict(zip(header, cells)))
        elif not line.startswith("|"):
            header = None
    assert rows
    return rows


def test_the_reproduce_index_has_a_network_column():
    rows = _reproduce_rows()
    assert all(r.get("network", "").startswith(("yes", "no", "-")) for r in rows), \
        [r["make target"] for r in rows if not r.get("network", "").startswith(("yes", "no", "-"))]
    network = {t: r["network"] for r in rows for t in re.findall(r"`([a-z0-9][a-z0-9-]*)`", r["make target"])}
    needs_tasks = re.findall(r"^([a-z0-9][a-z0-9-]*):[^#\n]*\$\(TASKS\)", MAKEFILE.read_text(encoding="utf-8"),
                             re.MULTILINE)
    assert needs_tasks, "no target of analyses/Makefile depends on $(TASKS)"
    listed = [t for t in needs_tasks if t in network]
    assert listed and all(network[t].startswith("yes") for t in listed), \
        {t: network[t] for t in listed if not network[t].startswith("yes")}
    assert network["pressure"] == "no" and network["tasks"].startswith("yes")


def _minutes(cell: str) -> set[str]:
    return set(re.findall(r"\d[\d,.]*\d|\d|not recorded|not run", cell))


def test_each_row_names_existing_targets_tables_and_the_indexed_minutes():
    targets = set(re.findall(r"^([a-z0-9][a-z0-9-]*)\s*:(?!=)", MAKEFILE.read_text(encoding="utf-8"), re.MULTILINE))
    reproduce = _reproduce_rows()
    for n, row in findings(INDEX).items():
        named = re.findall(r"`([a-z0-9][a-z0-9-]*)`", row["make target"])
        assert named and set(named) <= targets, (n, named)
        for path in re.findall(r"`(figures/[^`]+)`", row["committed table"]):
            assert (ROOT / path).is_file(), (n, path)
        minutes = next(r["minutes on 2 cores"] for r in reproduce if f"`{named[0]}`" in r["make target"])
        assert _minutes(row["minutes on 2 cores"]) & _minutes(minutes), \
            f"row {n}: minutes {row['minutes on 2 cores']!r}, the Reproduce index says {minutes!r} for {named[0]}"
        assert row["network"].startswith("yes" if "yes" in next(
            r["network"] for r in reproduce if f"`{named[0]}`" in r["make target"]) else "no"), (n, row["network"])


def test_the_two_samples_of_mini_en_pressure_are_named_where_they_are_quoted():
    """The atlases' 48-window values (0.477 / 0.272, ratio 0.501) are what the atlas CSV holds, their intervals
    hold the full-sample values of rows 2-3, and each page quoting them says which sample it is."""
    atlas = _csv("atlas/atlas.csv")
    atlas = atlas[atlas["model"] == "gradflow-mini-en"].set_index(["depth_fraction", "metric"])
    full_pressure, _ = EXPECTED[3]()
    full_ratio = EXPECTED[2]()[0][0]
    for key, printed_value, full in [((1.0, "pressure:attn.q"), 0.477, full_pressure[0]),
                                     ((1.0, "pressure:ffn.in"), 0.272, full_pressure[1]),
                                     ((0.0, "context_loss_ratio"), 0.501, full_ratio)]:
        row = atlas.loc[key]
        assert not disagreements(f"{printed_value:.3f}", [row["value"]]), key
        assert row["ci_low"] <= full <= row["ci_high"], (key, full)  # a smaller sample, not another quantity
    for page in ("docs/results/index.md", "docs/results/probes-and-pressure.md", "docs/results/twelve-blocks.md"):
        text = (ROOT / page).read_text(encoding="utf-8")
        assert "0.477 / 0.272" in text and "0.472 / 0.287" in text and "48 windows" in text, page


def test_the_readme_headline_estimates_are_the_committed_ratios():
    """The demo paragraph above the findings (README.md and docs/index.md) quotes row 2's ratios and the twin's
    after its last block, under its own all-positions loss; each estimate is the committed one."""
    ratios = _csv("report/compare_models/tables/ratios.csv").set_index(["label", "layer", "role"])
    committed = [ratios.loc[("mini-en, MLM loss", 0, "context")], ratios.loc[("mini-en, MLM loss", 5, "context")],
                 ratios.loc[("alltoken twin, all-positions loss", 6, "context")]]
    for page in COPIES:
        text = page.read_text(encoding="utf-8")
        head = " ".join(text[: text.index("## What it found")].split())
        quoted = re.findall(r"\d\.\d+ \[\d\.\d+, \d\.\d+\]", head)
        assert len(quoted) == 3, (page.name, quoted)
        for cell, row in zip(quoted, committed):
            assert not disagreements(cell, [row["ratio"], row["ci_low"], row["ci_high"]]), (page.name, cell)


# ---------------------------------------------------------------------- point 5: the docs read unbuilt
NOTE = re.compile(r"mkdocs serve")


@pytest.mark.parametrize("page", COPIES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_top_says_how_to_read_the_docs(page):
    text = page.read_text(encoding="utf-8")
    head = text[: text.index("\n## ")] if "\n## " in text else text
    first_paragraphs = head.split("```\n", 2)[-1][:600]  # the text right after the two commands
    assert NOTE.search(first_paragraphs) and "--8<--" in first_paragraphs and "figures/" in first_paragraphs, page


def test_raw_pages_name_committed_files():
    """Every ``--8<--`` include names a file from the repository root, and every image under ``figures/``
    names a committed figure (the site publishes ``figures/`` at its root: docs/hooks.py)."""
    missing = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        text = page.read_text(encoding="utf-8")
        for path in re.findall(r'^--8<-- "([^"]+)"$', text, re.MULTILINE):
            if not (ROOT / path.split(":")[0]).is_file():  # FILE:START:END names lines of FILE
                missing.append(f"{page.relative_to(ROOT)}: include {path}")
        depth = len(page.relative_to(ROOT / "docs").parts) - 1
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text):
            parts = Path(target).parts
            in_figures = parts[:depth] == ("..",) * depth and parts[depth:depth + 1] == ("figures",)
            if in_figures and not (ROOT / Path(*parts[depth:])).is_file():
                missing.append(f"{page.relative_to(ROOT)}: image {target}")
    assert not missing, missing
