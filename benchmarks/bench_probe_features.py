"""Probe feature extraction, measured side by side: the forward stopped at the last site vs the whole one.

``gradflow probe`` reads every site's hidden state of each batch of sentences. Two ways, timed in
interleaved rounds on the same batches (sentences from the package's committed sample, cut at
``--words`` words, ``--batch`` at a time):

- whole:  the whole forward (encoder and MLM head), first-sub-word features by a 0/1 pooling matmul
          (gradflow before 2026-11-28)
- early:  :func:`gradflow.runs.probe_features.site_states` (the forward ends once every site is stored, so
          the MLM head does not run) and :func:`~gradflow.runs.probe_features.pool_words` (rows gathered)

Prints per way the median seconds per batch and the ratio early / whole, and whether every feature is
bit-identical between the two (it must be). Not a test: numbers are printed, never asserted.

    python benchmarks/bench_probe_features.py [--model gradflow-mini-en] [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from gradflow.hooks.sites import SiteLayer
from gradflow.inputs.labelled import LabelledSentences
from gradflow.models import load_model
from gradflow.runs.probe_features import _Item, pool_words, site_states, tokenised_words, word_pooling
from gradflow.runs.record import default_texts


def sentence_batches(loaded, words: int, batch: int, batches: int) -> list[list[_Item]]:
    """``batches`` batches of ``batch`` sentences of ``words`` words from the committed sample, as probe items."""
    text = " ".join(default_texts()).split()
    chunks = tuple(tuple(text[s * words:(s + 1) * words]) for s in range(batch * batches))
    sentences = LabelledSentences(chunks, tuple(("x",) * len(c) for c in chunks))
    items = [_Item(ids, [(s, w, p) for w, p in enumerate(positions)])
             for s, (ids, positions) in enumerate(tokenised_words(loaded.tokenizer, sentences, 128))]
    return [items[i:i + batch] for i in range(0, len(items), batch)]


def features(loaded, sites: SiteLayer, batch: list[_Item], early: bool) -> list[torch.Tensor]:
    """Every site's word features of one batch, by either way."""
    width = max(len(item.ids) for item in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    attention = torch.zeros_like(ids)
    for b, item in enumerate(batch):
        ids[b, :len(item.ids)] = torch.tensor(item.ids)
        attention[b, :len(item.ids)] = 1
    store = site_states(loaded.model, sites, {"input_ids": ids, "attention_mask": attention}, stop_early=early)
    pooling = word_pooling(batch, width, "first")
    out = []
    for site in sites.names:
        hidden = store[site].float().reshape(len(batch) * width, -1)
        if early:
            out.append(pool_words(hidden, pooling))
        else:
            onehot = torch.zeros(len(pooling.keys), len(batch) * width)
            onehot[torch.arange(len(pooling.keys)), pooling.rows] = 1.0
            out.append(onehot @ hidden)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gradflow-mini-en")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=4, help="batches timed per way and round")
    parser.add_argument("--batch", type=int, default=32, help="sentences per batch (gradflow probe's default)")
    parser.add_argument("--words", type=int, default=22, help="words per sentence (Brown's mean is about 22)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    loaded.model.eval()
    sites = SiteLayer(loaded.model, loaded.adapter, mid=False)
    data = sentence_batches(loaded, args.words, args.batch, args.batches)
    print(json.dumps({"model": args.model, "threads": args.threads, "batch": args.batch, "words": args.words,
                      "sites": len(sites.names), "torch": torch.__version__, "loadavg": os.getloadavg()}))
    identical = all(torch.equal(a, b) for batch in data
                    for a, b in zip(features(loaded, sites, batch, True), features(loaded, sites, batch, False)))
    times: dict[str, list[float]] = {"whole": [], "early": []}
    for _ in range(args.rounds):
        for way in times:
            start = time.perf_counter()
            for batch in data:
                features(loaded, sites, batch, way == "early")
            times[way].append((time.perf_counter() - start) / len(data))
    whole, early = statistics.median(times["whole"]), statistics.median(times["early"])
    print(json.dumps({"whole_s_per_batch": round(whole, 4), "early_s_per_batch": round(early, 4),
                      "early_over_whole": round(early / whole, 3), "bit_identical": identical}))


if __name__ == "__main__":
    main()
