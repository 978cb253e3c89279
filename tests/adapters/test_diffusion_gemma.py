"""DiffusionGemma (block diffusion, transformers' ``diffusion_gemma``): the physics the adapter relies on, measured.

A tiny DiffusionGemmaForBlockDiffusion (3 tied blocks, hidden 32, 4 experts, vocabulary 64;
``tests/tiny_diffusion_gemma.py``) runs a prompt through the causal encoder and a canvas through the bidirectional
decoder; the loss sits at some canvas positions (masked diffusion), or at all of them (the published recipe). These
tests measure what :mod:`gradflow.adapters.diffusion_gemma` states with plain autograd, no gradflow hook: the last
decoder block's zero from positions without loss holds, the prompt reaches the last block only through the keys of
the encoder's last layer, and every earlier block's tied weights take gradient from both passes (which is why the
recorder joins the two passes of each depth: tests/hooks/test_two_pass.py). Then: the type is supported, loads with
its own class, the coverage page says so, and the adapter's final norm and head reproduce the logits.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoConfig

from gradflow.adapters import adapter_for
from gradflow.adapters.coverage import coverage_markdown, masked_lm_model_types
from gradflow.adapters.refusals import REFUSED_BEYOND_MLM, refusal
from gradflow.models.loading import load_model
from tiny_diffusion_gemma import BATCH, CANVAS, PROMPT, VOCAB, build_tiny_diffusion_gemma_dir, tiny_diffusion_gemma

# modules of a block that read only their own position after attention (zero from positions without loss in the
# last block), and those on the key/value path (not zero); the flattened ones run on (B * T, H)
AFTER_MIXING = ("self_attn.q_proj", "self_attn.q_norm", "self_attn.o_proj", "post_attention_layernorm",
                "pre_feedforward_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                "post_feedforward_layernorm_1", "pre_feedforward_layernorm_2", "router.proj", "experts",
                "post_feedforward_layernorm_2", "post_feedforward_layernorm")
KEY_PATH = ("input_layernorm", "self_attn.k_proj", "self_attn.k_norm", "self_attn.v_norm")
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
           "mlp.down_proj", "router.proj")


def _inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    prompt, canvas, target = (torch.randint(3, 60, (BATCH, n), generator=gen) for n in (PROMPT, CANVAS, CANVAS))
    return prompt, canvas, target


PARTIAL = torch.zeros(BATCH, CANVAS, dtype=torch.bool)
PARTIAL[0, [1, 4]] = True
PARTIAL[1, 2] = True
WHOLE = torch.ones(BATCH, CANVAS, dtype=torch.bool)


def _layers(model) -> dict[str, nn.ModuleList]:
    return {"enc": model.model.encoder.language_model.layers, "dec": model.model.decoder.layers}


def _backward(model, loss_at: torch.Tensor) -> dict[tuple[str, int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(pass, depth, module) -> (input, output gradient), each (B, T, D), after a cross-entropy loss at the canvas
    positions ``loss_at`` (B, CANVAS); the parameters' .grad hold autograd's gradient. A module whose output the
    loss does not reach gets a zero gradient."""
    prompt, canvas, target = _inputs()
    seen: dict[tuple[str, int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    handles = []
    for side, layers in _layers(model).items():
        for depth, layer in enumerate(layers):
            for name in AFTER_MIXING + KEY_PATH:
                handles.append(layer.get_submodule(name).register_forward_hook(
                    lambda mod, args, out, key=(side, depth, name): seen.__setitem__(key, (args[0], out))))
    model.zero_grad()
    try:
        logits = model(input_ids=prompt, decoder_input_ids=canvas).logits
    finally:
        for handle in handles:
            handle.remove()
    assert logits.shape == (BATCH, CANVAS, VOCAB)
    ce = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), reduction="none")
    loss = ce[loss_at.reshape(-1)].sum()
    outputs = [out for _, out in seen.values()]
    grads = torch.autograd.grad(loss, outputs, allow_unused=True, retain_graph=True)
    loss.backward()
    result = {}
    for (key, (inp, out)), grad in zip(seen.items(), grads):
        grad = torch.zeros_like(out) if grad is None else grad
        length = PROMPT if key[0] == "enc" else CANVAS
        result[key] = (inp.reshape(BATCH, length, -1), grad.reshape(BATCH, length, -1))
    return result


def _per_position(grad: torch.Tensor) -> torch.Tensor:
    """(B, T) largest |gradient| of each position."""
    return grad.abs().amax(-1)


@pytest.fixture(scope="module")
def model():
    return tiny_diffusion_gemma()


def test_two_passes_through_tied_blocks(model):
    """The structure the refusal states: a causal encoder and a bidirectional decoder sharing every block
    parameter, no v_proj in full-attention layers, 3-D expert weights, logits for the canvas only, and a random
    canvas when none is given; transformers maps the type to no masked-LM class."""
    assert "diffusion_gemma" not in masked_lm_model_types()
    layers = _layers(model)
    for enc, dec in zip(layers["enc"], layers["dec"]):
        assert enc.self_attn.is_causal and not dec.self_attn.is_causal
        enc_params, dec_params = dict(enc.named_parameters()), dict(dec.named_parameters())
        assert enc_params.keys() == dec_params.keys()
        assert all(enc_params[name] is dec_params[name] for name in enc_params)
    last = layers["dec"][-1]
    assert model.config.text_config.layer_types[-1] == "full_attention" and last.self_attn.v_proj is None
    assert layers["dec"][0].self_attn.v_proj is not None
    assert last.experts.gate_up_proj.dim() == 3 and not isinstance(last.experts, nn.Linear)
    prompt, canvas, _ = _inputs()
    with torch.no_grad():
        assert model(input_ids=prompt, decoder_input_ids=canvas).logits.shape == (BATCH, CANVAS, VOCAB)
        torch.manual_seed(0)
        first = model(input_ids=prompt).logits
        torch.manual_seed(1)
        assert not torch.equal(first, model(input_ids=prompt).logits)  # a random canvas of canvas_length tokens
    assert first.shape == (BATCH, CANVAS, VOCAB)


def test_partial_canvas_loss_last_block_zero(model):
    """Loss at 3 of 16 canvas positions: in the last decoder block every module after attention gets exactly zero
    gradient at the 13 others, the key path does not; in earlier blocks nothing is zero."""
    grads = _backward(model, PARTIAL)
    last = len(_layers(model)["dec"]) - 1
    for name in AFTER_MIXING:
        per = _per_position(grads["dec", last, name][1])
        assert torch.all(per[~PARTIAL] == 0), name
        assert torch.all(per[PARTIAL] > 0), name
    for name in KEY_PATH:
        assert torch.all(_per_position(grads["dec", last, name][1]) > 0), name
    for depth in range(last):
        for name in AFTER_MIXING + KEY_PATH:
            assert torch.all(_per_position(grads["dec", depth, name][1]) > 0), (depth, name)


@pytest.mark.parametrize("loss_at", [PARTIAL, WHOLE], ids=["partial", "whole canvas"])
def test_prompt_reaches_the_last_block_only_through_keys(model, loss_at):
    """The encoder's last layer (the last block's parameters on the prompt): its modules after attention get no
    gradient at all, its key path gets gradient at every prompt position; earlier encoder layers get it everywhere
    (but at the first prompt position's query: in causal attention it sees only its own key, a softmax over one key,
    whose gradient is zero up to rounding)."""
    grads = _backward(model, loss_at)
    last = len(_layers(model)["enc"]) - 1
    for name in AFTER_MIXING:
        assert torch.all(grads["enc", last, name][1] == 0), name
    for name in KEY_PATH:
        assert torch.all(_per_position(grads["enc", last, name][1]) > 0), name
    for depth in range(last):
        for name in AFTER_MIXING + KEY_PATH:
            per = _per_position(grads["enc", depth, name][1])
            if name in ("self_attn.q_proj", "self_attn.q_norm"):
                assert torch.all(per[:, 0] < 1e-6), (depth, name)
                per = per[:, 1:]
            assert torch.all(per > 0), (depth, name)


def test_whole_canvas_loss_leaves_no_canvas_position_without_loss(model):
    """The published recipe's loss (every canvas position): no module of the last decoder block has a zero at any
    canvas position; the prompt positions are the only ones without loss."""
    grads = _backward(model, WHOLE)
    last = len(_layers(model)["dec"]) - 1
    for name in AFTER_MIXING + KEY_PATH:
        assert torch.all(_per_position(grads["dec", last, name][1]) > 0), name


def _contribution(inp: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A Linear's weight gradient from one pass: the sum over positions of grad ⊗ input."""
    return grad.reshape(-1, grad.shape[-1]).T @ inp.reshape(-1, inp.shape[-1])


def test_tied_weight_gradient_is_both_passes(model):
    """Each Linear's autograd gradient is the decoder pass (canvas) plus the encoder pass (prompt). In every block
    but the last the encoder pass is non-zero for all of them, so a split of the decoder pass alone does not sum to
    autograd; in the last block it is exactly zero except on the key path (k_proj)."""
    grads = _backward(model, PARTIAL)
    layers = _layers(model)
    last = len(layers["dec"]) - 1
    for depth, layer in enumerate(layers["dec"]):
        for name in LINEARS:
            encoder, decoder = (_contribution(*grads[side, depth, name]) for side in ("enc", "dec"))
            weight = layer.get_submodule(name).weight
            torch.testing.assert_close(encoder + decoder, weight.grad, rtol=1e-5, atol=1e-7)
            if depth < last or name == "self_attn.k_proj":
                assert encoder.norm() > 1e-3 * weight.grad.norm(), (depth, name)
                assert not torch.allclose(decoder, weight.grad, rtol=1e-3, atol=0), (depth, name)
            else:
                assert torch.all(encoder == 0), name


def test_supported_loaded_with_its_own_class(tmp_path):
    """No refusal is left; the registered adapter is the two-pass one; a checkpoint directory loads with
    ``DiffusionGemmaForBlockDiffusion`` (no masked-LM class maps the type) and its tokenizer; the coverage page lists
    the type as supported by transformers' own class."""
    assert REFUSED_BEYOND_MLM == {} and refusal("diffusion_gemma") is None
    assert "diffusion_gemma" not in masked_lm_model_types()
    adapter = adapter_for(AutoConfig.for_model("diffusion_gemma"))
    assert adapter.family == "diffusion_gemma" and adapter.two_pass is not None
    assert {"attn.q", "attn.out", "ffn.router", "ffn.experts.gate_up_proj", "ffn.experts.down_proj"} <= set(
        adapter.after_mixing())
    assert not {"attn.k", "attn.v", "attn.norm"} & set(adapter.after_mixing())
    loaded = load_model(str(build_tiny_diffusion_gemma_dir(tmp_path / "dg")))
    assert type(loaded.model).__name__ == "DiffusionGemmaForBlockDiffusion" and loaded.adapter is adapter
    assert not loaded.model.training and loaded.tokenizer.mask_token_id is not None
    page = coverage_markdown()
    assert "| `diffusion_gemma` | DiffusionGemma (`DiffusionGemmaForBlockDiffusion`) | supported (diffusion_gemma, " \
           "transformers) |" in page


def test_declared_final_norm_and_head_reproduce_the_logits(model):
    """The adapter's final norm (``decoder.norm``) and head (``lm_head`` then the tanh softcap) on the last decoder
    block's output give the model's logits."""
    from gradflow.adapters.diffusion_gemma import DIFFUSION_GEMMA

    prompt, canvas, _ = _inputs()
    seen = {}
    handle = model.model.decoder.layers[-1].register_forward_hook(lambda m, a, out: seen.setdefault("out", out))
    try:
        with torch.no_grad():
            logits = model(input_ids=prompt, decoder_input_ids=canvas).logits
            hidden = model.model.get_submodule(DIFFUSION_GEMMA.final_norm)(seen["out"])
            assert torch.equal(DIFFUSION_GEMMA.head.function(model)(hidden), logits)
    finally:
        handle.remove()
