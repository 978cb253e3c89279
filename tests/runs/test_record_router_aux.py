"""``record_corpus`` with ``router_aux_loss`` (issue 61, part 2) on a tiny OLMoE: ``router_aux.csv`` and meta.json's
``router_aux_loss`` block; without the option nothing changes (no table, no key, the last block's router exactly 0.0
from context positions); the norms add over batches, survive a checkpoint's JSON and merge across processes."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from gradflow.adapters.moe import OLMOE
from gradflow.models.loading import LoadedModel
from gradflow.runs.record import RecordConfig, record_corpus
from gradflow.runs.record_stats import RecordStats
from gradflow.runs.resume import restore_fields, stats_state
from gradflow.schema import META_FILE, ROUTER_AUX_DTYPES, ROUTER_AUX_FILE, SUBLAYERS_FILE


def _olmoe(tokenizer_dir) -> LoadedModel:
    """A 2-block OLMoE (4 experts, top-2) over the tiny BERT's tokenizer, routers away from their zero init."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = AutoConfig.for_model("olmoe", vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=2, intermediate_size=24,
                                  max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
                                  pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):
                param.add_(0.1 * torch.randn_like(param))
    return LoadedModel(model, tokenizer, "tiny-olmoe", str(tokenizer_dir), OLMOE, "")


def _run(tmp_path, tiny_mlm_dir, tiny_corpus, name: str, aux):
    out = tmp_path / name
    config = RecordConfig(out=str(out), model=str(tiny_mlm_dir), texts=str(tiny_corpus), limit=6, batch_size=3,
                          max_length=24, quiet=True, router_aux_loss=aux)
    record_corpus(config, loaded=_olmoe(tiny_mlm_dir))
    return out


def _router_context(out) -> float:
    table = pd.read_csv(out / SUBLAYERS_FILE)
    row = table[(table.layer == 2) & (table.sublayer == "ffn.router") & (table.role == "context")]
    assert len(row) == 1
    return float(row.contribution_norm_mean.iloc[0])


def test_router_aux_table_and_meta(tmp_path, tiny_mlm_dir, tiny_corpus):
    out = _run(tmp_path, tiny_mlm_dir, tiny_corpus, "aux", "model")
    table = pd.read_csv(out / ROUTER_AUX_FILE)
    assert tuple(table.columns) == tuple(ROUTER_AUX_DTYPES)
    names = ["ffn.experts.down_proj", "ffn.experts.gate_up_proj", "ffn.router"]
    assert table[["layer", "sublayer"]].values.tolist() == [[layer, name] for layer in (1, 2) for name in names]
    got = table.set_index(["layer", "sublayer"])
    assert (got.norm_loss > 0).all()
    assert got.loc[(2, "ffn.router"), "norm_aux"] > 0 and got.loc[(1, "ffn.experts.down_proj"), "norm_aux"] > 0
    assert got.loc[(2, "ffn.experts.down_proj"), "norm_aux"] == 0.0  # nothing the term reads comes after them
    assert got.loc[(2, "ffn.experts.gate_up_proj"), "norm_aux"] == 0.0
    meta = json.loads((out / META_FILE).read_text())
    block = meta["router_aux_loss"]
    assert block["requested"] == "model" and block["coefficient"] == pytest.approx(0.01)  # OLMoE's default
    assert block["mean_term"] > 0 and block["table"] == ROUTER_AUX_FILE
    assert _router_context(out) > 0


def test_without_the_option_nothing_changes(tmp_path, tiny_mlm_dir, tiny_corpus):
    out = _run(tmp_path, tiny_mlm_dir, tiny_corpus, "plain", None)
    assert not (out / ROUTER_AUX_FILE).exists()
    assert "router_aux_loss" not in json.loads((out / META_FILE).read_text())
    assert _router_context(out) == 0.0


class _Record:
    def __init__(self, aux_loss: float, norms: dict):
        self.roles = torch.zeros((1, 4), dtype=torch.int8)
        self.loss, self.aux_loss, self.router_aux, self.expert_counts = 1.0, aux_loss, norms, {}


def test_norms_add_survive_a_checkpoint_and_merge():
    stats = RecordStats(aux_coef=0.01)
    stats.add_record(_Record(0.5, {(1, "ffn.router", "weight"): (2.0, 1.0)}))
    stats.add_record(_Record(0.25, {(1, "ffn.router", "weight"): (4.0, 0.5)}))
    restored = RecordStats()
    restore_fields(restored, json.loads(json.dumps(stats_state(stats))))
    assert restored.router_aux == stats.router_aux and restored.aux_coef == 0.01
    other = RecordStats(aux_coef=0.01)
    other.add_record(_Record(0.75, {(1, "ffn.router", "weight"): (6.0, 3.0)}))
    restored.merge(other)
    frame = restored.router_aux_frame()
    assert frame.to_dict("records") == [{"layer": 2, "sublayer": "ffn.router", "param": "weight",
                                         "norm_loss": 4.0, "norm_aux": 1.5}]
    assert restored.aux_meta("model")["router_aux_loss"]["mean_term"] == pytest.approx(0.5)
    assert restored.aux_meta(None) == {}
