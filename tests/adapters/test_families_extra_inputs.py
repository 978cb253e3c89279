"""Issue 30, helper G4: TAPAS and RoCBert (extra inputs), MRA, Nystromformer and Reformer (refused:
the last block's query gets context gradient, measured here on tiny models), the vision-language encoders."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForMaskedLM
from transformers.models.mra import modeling_mra

from gradflow import GradFlowRecorder, RecorderConfig, mlm_loss
from gradflow.adapters import adapter_for
from gradflow.adapters.extra_inputs import token_inputs
from gradflow.adapters.refusals import REFUSED
from gradflow.errors import UnsupportedArchitectureError
from gradflow.inputs.masking import ExplicitMasking, MaskedBatch, mask_batch
from gradflow.roles import Role
from tiny import COMMON, tiny_batch, tiny_model


def _build(model_type: str, **overrides) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type)
    for key, value in {**COMMON, **overrides}.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return AutoModelForMaskedLM.from_config(config).eval()


def _output_grad(model: torch.nn.Module, module: torch.nn.Module, batch) -> torch.Tensor:
    """d(MLM loss)/d(module output) (B, T, ...): every call's gradient summed (Reformer calls it in the
    reversible backward's recomputation, with grad enabled, which is where the gradient exists)."""
    grads: list[torch.Tensor] = []

    def hook(mod, inputs, output):
        if output.requires_grad:
            output.register_hook(lambda g: grads.append(g.detach().clone()))

    handle = module.register_forward_hook(hook)
    try:
        model.zero_grad()
        mlm_loss(model(**batch.model_inputs()).logits, batch).backward()
    finally:
        handle.remove()
    assert grads, "the module's output never received a gradient"
    return torch.stack(grads).sum(0)


def _context(batch) -> torch.Tensor:
    return batch.roles == Role.CONTEXT


def _unpadded(batch: MaskedBatch) -> MaskedBatch:
    """The batch without its padded last row."""
    return MaskedBatch(batch.input_ids[:-1], batch.original_ids[:-1], batch.labels[:-1], batch.roles[:-1],
                       batch.attention_mask[:-1], batch.sequence_index[:-1])


# ---------------------------------------------------------------------------------------------
# Nystromformer: landmark queries are segment means of every position's query
# ---------------------------------------------------------------------------------------------

NYSTROM = dict(segment_means_seq_len=16, num_landmarks=4, conv_kernel_size=3)
# unpadded batches: in the installed transformers the landmark branch adds a (B, 1, T, T) padding mask to
# (B, heads, landmarks, T) scores and fails on any padded batch


def test_nystromformer_last_block_query_gets_context_gradient():
    batch = _unpadded(tiny_batch(t=16))
    model = _build("nystromformer", **NYSTROM)
    grad = _output_grad(model, model.base_model.encoder.layer[-1].attention.self.query, batch)
    context = grad[_context(batch)]
    assert torch.all(context.abs().sum(-1) > 0)  # every context position's query reaches the loss
    with pytest.raises(UnsupportedArchitectureError, match="does not hold: with num_landmarks=4 < segment_means"):
        adapter_for(model)


def test_nystromformer_exact_attention_keeps_the_query_zero():
    """Contrast: with as many landmarks as positions the attention is exact softmax and the zero is back."""
    batch = _unpadded(tiny_batch(t=16))
    model = _build("nystromformer", **{**NYSTROM, "num_landmarks": 16})
    grad = _output_grad(model, model.base_model.encoder.layer[-1].attention.self.query, batch)
    assert torch.count_nonzero(grad[_context(batch)]) == 0
    assert torch.count_nonzero(grad[batch.roles == Role.MASKED]) > 0
    assert adapter_for(model).family == "nystromformer"  # supported; the family tests run it (tests/tiny.py)


# ---------------------------------------------------------------------------------------------
# MRA: no attention without its kernel; block-mean queries with it (approx_mode "full")
# ---------------------------------------------------------------------------------------------

@pytest.mark.skipif(modeling_mra.mra_cuda_kernel is not None, reason="the MRA kernel is loaded")
def test_mra_without_its_kernel_mixes_no_positions():
    batch = tiny_batch()
    model = _build("mra")
    grad = _output_grad(model, model.base_model.embeddings, batch)
    assert torch.count_nonzero(grad[_context(batch)]) == 0  # no context channel reaches the loss at all
    assert torch.count_nonzero(grad[batch.roles == Role.MASKED]) > 0
    query = model.base_model.encoder.layer[0].attention.self.query
    assert query.weight.grad is None or torch.count_nonzero(query.weight.grad) == 0
    assert "does not hold" in REFUSED["mra"]


def test_mra_low_resolution_term_averages_queries_over_blocks():
    """The kernel path's low-resolution logits (plain PyTorch in the installed code) read block means
    of the queries: one block's logits get gradient from every query of the block."""
    torch.manual_seed(0)
    query = torch.randn(1, 8, 4, requires_grad=True)
    key = torch.randn(1, 8, 4)
    logit, *_ = modeling_mra.get_low_resolution_logit(query, key, block_size=4, mask=torch.ones(1, 8))
    logit[0, 0].sum().backward()  # the logits of block 0 (positions 0-3)
    assert torch.all(query.grad[0, :4].abs().sum(-1) > 0)
    assert torch.count_nonzero(query.grad[0, 4:]) == 0


# ---------------------------------------------------------------------------------------------
# Reformer: LSH attention shares one projection for queries and keys
# ---------------------------------------------------------------------------------------------

REFORMER = dict(axial_pos_embds_dim=(16, 16), axial_pos_shape=(4, 4), max_position_embeddings=16,
                attention_head_size=16, feed_forward_size=48, lsh_attn_chunk_length=4,
                local_attn_chunk_length=4, num_buckets=2, num_hashes=1, is_decoder=False, pad_token_id=0,
                hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0, lsh_attention_probs_dropout_prob=0.0)


def _reformer(attn_layers: list[str]) -> torch.nn.Module:
    """A tiny Reformer in training mode (its reversible backward asserts it) with every dropout at 0."""
    return _build("reformer", **REFORMER, attn_layers=attn_layers).train()


def test_reformer_lsh_last_block_query_gets_context_gradient():
    batch = tiny_batch(t=16)
    model = _reformer(["local", "lsh", "lsh"])
    last = model.base_model.encoder.layers[-1].attention.self_attention
    grad = _output_grad(model, last.query_key, batch)
    reached = grad[_context(batch)].abs().sum(-1) > 0
    assert int(reached.sum()) > reached.numel() // 2  # most context positions' queries are keys a loss position reads
    assert "does not hold" in REFUSED["reformer"]


def test_reformer_local_last_block_keeps_the_query_zero():
    """Contrast: local attention has its own query projection, which only forms the position's own row."""
    batch = tiny_batch(t=16)
    model = _reformer(["lsh", "lsh", "local"])
    last = model.base_model.encoder.layers[-1].attention.self_attention
    grad = _output_grad(model, last.query, batch)
    assert torch.count_nonzero(grad[_context(batch)]) == 0
    assert torch.count_nonzero(grad[batch.roles == Role.MASKED]) > 0


@pytest.mark.parametrize("model_type", ["mra", "reformer"])
def test_refused_with_the_argument(model_type):
    with pytest.raises(UnsupportedArchitectureError, match="does not hold"):
        adapter_for(AutoConfig.for_model(model_type))


# ---------------------------------------------------------------------------------------------
# TAPAS: text only, every token-type channel 0 (what its tokenizer gives the text segment)
# ---------------------------------------------------------------------------------------------

VOCAB_WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "a", "1", "2",
               "name", "age", "##s"]


def _vocab_file(tmp_path) -> str:
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(VOCAB_WORDS) + "\n")
    return str(path)


def test_tapas_tokenizer_gives_the_text_segment_zero_in_every_channel(tmp_path):
    pd = pytest.importorskip("pandas")
    from transformers import TapasTokenizer

    tokenizer = TapasTokenizer(_vocab_file(tmp_path))
    table = pd.DataFrame({"name": ["cat"], "age": ["2"]})
    enc = tokenizer(table=table, queries="the cat sat on the mat", return_tensors="pt")
    types = enc["token_type_ids"][0]  # (T, 7)
    text = types[:, 0] == 0  # segment 0: [CLS] text [SEP]
    assert int(text.sum()) == 8 and torch.count_nonzero(types[text]) == 0
    assert torch.count_nonzero(types[~text][:, 1:3]) > 0  # table cells do carry column and row ids


def test_tapas_text_without_table_is_bert_wordpiece_on_its_vocabulary(tmp_path):
    pd = pytest.importorskip("pandas")
    from transformers import BertTokenizerFast, TapasTokenizer

    text = "The cats sat on the mat, 12 cats"
    tapas = TapasTokenizer(_vocab_file(tmp_path))(table=pd.DataFrame(), queries=text)
    assert tapas["input_ids"] == BertTokenizerFast(_vocab_file(tmp_path))(text)["input_ids"]
    assert not any(any(channels) for channels in tapas["token_type_ids"])


def test_tapas_without_token_types_is_the_all_zero_input():
    model = _build("tapas")
    batch = tiny_batch()
    zeros = torch.zeros(*batch.input_ids.shape, 7, dtype=torch.long)
    with torch.no_grad():
        default = model(**batch.model_inputs()).logits
        explicit = model(**batch.model_inputs(), token_type_ids=zeros).logits
        other = model(**batch.model_inputs(), token_type_ids=zeros + 1).logits
    assert torch.equal(default, explicit)
    assert not torch.allclose(default, other)  # the channels are read: zeros are a choice, stated in the notes
    assert "text only" in adapter_for(model).notes


# ---------------------------------------------------------------------------------------------
# RoCBert: shape and pronunciation ids derived from the ids with the tokenizer's own tables
# ---------------------------------------------------------------------------------------------

SHAPES = {"the": 3, "cat": 4, "[UNK]": 1, "[MASK]": 7}
SOUNDS = {"the": 5, "sat": 6, "[UNK]": 2}
ROC_BERT = dict(shape_vocab_size=16, pronunciation_vocab_size=16, shape_embed_dim=8, pronunciation_embed_dim=8)


@pytest.fixture
def roc_tokenizer(tmp_path):
    import json

    from transformers import RoCBertTokenizer

    (tmp_path / "shape.json").write_text(json.dumps(SHAPES))
    (tmp_path / "sound.json").write_text(json.dumps(SOUNDS))
    return RoCBertTokenizer(_vocab_file(tmp_path), str(tmp_path / "shape.json"), str(tmp_path / "sound.json"))


def test_token_inputs_match_the_roc_bert_tokenizer(roc_tokenizer):
    texts = ["the cat sat", "the mat on a cat sat", "cats sat"]  # "cats": two pieces, the second unknown to the tables
    enc = roc_tokenizer(texts, padding=True, return_tensors="pt")
    derived = token_inputs(roc_tokenizer, enc["input_ids"], enc["attention_mask"])
    assert set(derived) == {"input_shape_ids", "input_pronunciation_ids"}
    for name, ids in derived.items():
        assert torch.equal(ids, enc[name]), name
    assert token_inputs(object(), enc["input_ids"], enc["attention_mask"]) == {}  # other tokenizers: nothing


def test_masked_batches_carry_them_and_the_recorder_passes_them(roc_tokenizer):
    batch = mask_batch(roc_tokenizer, ["the cat sat on the mat", "a cat sat"],
                       ExplicitMasking(positions={0: (2,), 1: (2,)}), max_length=16)
    shapes = batch.extra_inputs["input_shape_ids"]
    assert torch.all(shapes[batch.roles == Role.MASKED] == SHAPES["[MASK]"])  # the [MASK] token's own id
    assert torch.equal(shapes, token_inputs(roc_tokenizer, batch.input_ids, batch.attention_mask)["input_shape_ids"])
    model = _build("roc_bert", **ROC_BERT)
    seen: list[torch.Tensor] = []
    handle = model.base_model.embeddings.shape_embed.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    try:
        with GradFlowRecorder(model, RecorderConfig()) as rec:
            record = rec.record(batch)
    finally:
        handle.remove()
    assert len(seen) == 1 and torch.equal(seen[0], shapes)
    grad, _ = record.site(f"blocks.{record.num_blocks - 1}.out")
    assert torch.count_nonzero(grad[batch.roles == Role.CONTEXT]) == 0
    with torch.no_grad():
        bare = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        full = model(**batch.model_inputs()).logits
    assert not torch.allclose(bare, full)  # the derived ids change what the model computes


# ---------------------------------------------------------------------------------------------
# Vision-language encoders on text alone: the text encoder's own forward
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["modernvbert", "ultravbert"])
def test_text_only_forward_is_the_text_encoders_own(family):
    model = tiny_model(family)
    batch = tiny_batch()
    wrapper = model.base_model
    with torch.no_grad():
        outer = wrapper(**batch.model_inputs()).last_hidden_state
        inner = wrapper.text_model(**batch.model_inputs()).last_hidden_state
    torch.testing.assert_close(outer, inner, rtol=0, atol=0)
    mlm_loss(model(**batch.model_inputs()).logits, batch).backward()
    vision = [p.grad for p in [*wrapper.vision_model.parameters(), *wrapper.connector.parameters()]]
    assert all(g is None for g in vision)  # the vision tower and connector are not on the text path
    assert "text only" in adapter_for(model).notes


# ---------------------------------------------------------------------------------------------
# NeoMME (refused, not supported yet): the zero pattern its adapter would state, measured
# ---------------------------------------------------------------------------------------------

def test_neomme_last_block_zero_pattern_for_its_future_adapter():
    config = AutoConfig.for_model("neomme", vocab_size=COMMON["vocab_size"], embedding_rank=16, hidden_size=32,
                                  intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=16, max_position_embeddings=64, sliding_window=4,
                                  layer_types=["sliding_attention", "full_attention", "full_attention"])
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_config(config).eval()
    with torch.no_grad():  # NeoMME zero-initialises its output projections, alpha and value embeddings
        for parameter in model.parameters():
            if torch.count_nonzero(parameter) == 0:
                parameter.normal_(0, 0.5)
    last = model.base_model.layers[-1]
    assert 2 in model.base_model.value_embedding_layers  # the last full-attention layer adds value embeddings
    grads: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(mod, inputs, output):
            output.register_hook(lambda g: grads.__setitem__(name, g))
        return hook

    def keep_value_embeds(mod, args, kwargs):
        value = kwargs["value_embeds"].clone()
        value.register_hook(lambda g: grads.__setitem__("value_embeddings", g))
        return args, {**kwargs, "value_embeds": value}

    attn = last.self_attn
    modules = {"q_proj": attn.q_proj, "k_proj": attn.k_proj, "v_proj": attn.v_proj,
               "o_proj": attn.output_projection.o_proj, "gate_proj": attn.output_projection.gate_proj,
               "up_proj": last.mlp.up_proj, "down_proj": last.mlp.down_proj}
    handles = [m.register_forward_hook(keep(n)) for n, m in modules.items()]
    handles.append(attn.register_forward_pre_hook(keep_value_embeds, with_kwargs=True))
    batch = tiny_batch()
    try:
        mlm_loss(model(**batch.model_inputs()).logits, batch).backward()
    finally:
        for handle in handles:
            handle.remove()
    context, masked = _context(batch), batch.roles == Role.MASKED
    for name in ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):  # read only their own position
        assert torch.count_nonzero(grads[name][context]) == 0 and torch.count_nonzero(grads[name][masked]) > 0, name
    for name in ("k_proj", "v_proj", "value_embeddings"):  # read by every loss position's attention
        assert torch.count_nonzero(grads[name][context]) > 0, name
    with pytest.raises(UnsupportedArchitectureError, match="not supported yet: NeoMME"):
        adapter_for(model)


def test_slow_tokenizer_documents_are_windowed_like_fast_overflow(roc_tokenizer):
    """A tokenizer without a fast version (RoCBert's) is windowed by the corpus reader: consecutive runs of
    max_length - 2 pieces, each in [CLS] ... [SEP], together exactly the document's pieces; the masked
    batches built from them carry the shape and pronunciation ids (corpus jobs work for RoCBert)."""
    from gradflow.inputs.corpus import Document, document_windows
    from gradflow.inputs.masking import BertMasking
    from gradflow.inputs.pipeline import masked_batches

    text = " ".join(["the cat sat on the mat", "a cats 12 sat"] * 7)
    pieces = roc_tokenizer(text, add_special_tokens=False)["input_ids"]
    windows = document_windows(roc_tokenizer, Document(0, text, "mem", 1), max_length=10)
    cls, sep = roc_tokenizer.cls_token_id, roc_tokenizer.sep_token_id
    assert [w["input_ids"][0] for w in windows] == [cls] * len(windows)
    assert [w["input_ids"][-1] for w in windows] == [sep] * len(windows)
    assert all(len(w["input_ids"]) <= 10 for w in windows) and len(windows) == -(-len(pieces) // 8)
    assert [i for w in windows for i in w["input_ids"][1:-1]] == pieces
    assert all(w["special_tokens_mask"] == [True] + [False] * (len(w["input_ids"]) - 2) + [True] for w in windows)
    documents = [Document(0, text, "mem", 1)]
    batch = next(masked_batches(roc_tokenizer, documents, BertMasking(seed=0), max_length=10, batch_size=4))
    assert batch.input_ids.shape == (4, 10)
    assert set(batch.extra_inputs) == {"input_shape_ids", "input_pronunciation_ids"}


def test_finetuning_passes_the_derived_token_inputs(roc_tokenizer):
    """gradflow finetune (and the probes' feature pass) give RoCBert its shape and pronunciation ids, the
    same as the tokenizer builds, instead of letting the model embed id 0 at every position."""
    from gradflow.interventions.finetune.train import model_inputs

    enc = roc_tokenizer(["the cat sat", "cats"], padding=True, return_tensors="pt")
    batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    inputs = model_inputs(batch, roc_tokenizer)
    assert set(inputs) == {"input_ids", "attention_mask", "input_shape_ids", "input_pronunciation_ids"}
    assert torch.equal(inputs["input_shape_ids"], enc["input_shape_ids"])
    assert torch.equal(inputs["input_pronunciation_ids"], enc["input_pronunciation_ids"])
    assert set(model_inputs(batch)) == {"input_ids", "attention_mask"}
