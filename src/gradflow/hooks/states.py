"""Hidden states of one batch at every site (no-grad forward; hooks removed afterwards)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gradflow.adapters import Adapter
from gradflow.hooks.sites import SiteLayer, layer_site, model_device, site_name
from gradflow.inputs.masking import MaskedBatch


@dataclass
class SiteStates:
    """Hidden states of one batch (CPU float32). ``hidden``: L + 1 tensors (B, T, H) (embeddings,
    then block outputs); ``mid``: L tensors (B, T, H); ``logits``: (B, T, V) or None."""

    hidden: list[torch.Tensor]
    mid: list[torch.Tensor]
    logits: torch.Tensor | None = None

    def select(self, rows: slice | Sequence[int]) -> "SiteStates":
        """The states of some rows (for streaming checks)."""
        pick = (lambda t: t[rows]) if isinstance(rows, slice) else (lambda t: t[list(rows)])
        return SiteStates([pick(h) for h in self.hidden], [pick(m) for m in self.mid],
                          None if self.logits is None else pick(self.logits))


def collect_states(model: nn.Module, batch: MaskedBatch, adapter: Adapter | None = None,
                   keep_logits: bool = True) -> SiteStates:
    """One no-grad forward of ``batch``; every site's hidden state (hooks removed afterwards)."""
    store: dict[str, torch.Tensor] = {}
    t = batch.input_ids.shape[1]

    def keep(site: str, hidden: torch.Tensor) -> None:
        store[site] = hidden.detach()[:, :t].float().cpu()  # positions a model appends (Longformer) are cut

    sites = SiteLayer(model, adapter, mid=True)
    with torch.no_grad(), sites.hooks(keep):
        logits = model(**batch.to(model_device(model)).model_inputs()).logits
    hidden = [store[layer_site(layer)] for layer in range(sites.num_blocks + 1)]
    mid = [store[site_name(depth, "mid")] for depth in range(sites.num_blocks)]
    return SiteStates(hidden, mid, logits.detach().float().cpu() if keep_logits else None)
