"""Explorer response time, measured side by side: one view request vs its bare forward+backward.

For a sentence of ``--tokens`` tokens (special tokens included; default 32) on gradflow-mini-en,
prints the median over ``--rounds`` interleaved rounds of:

- bare:      forward + MLM loss + ``autograd.grad`` to the embeddings (no hooks)
- view:      :func:`gradflow.explore.channel_view` (recorder with the sublayer split, table, shares)
- payload:   ``view.payload()`` serialised to JSON (what the page receives)
- http:      ``POST /api/view`` end to end through Starlette's test client (validation, queue, JSON)
- html:      ``view.to_html()``, the self-contained static page (with its size)

and each one's ratio to bare. Target (issue 17): http under 300 ms on a 2-core CPU. Not a test:
numbers are printed, never asserted.

    python benchmarks/bench_explore.py [--rounds 15] [--tokens 32] [--threads 2] [--device cpu]

With ``--device cuda`` the model sits on the GPU (every timing ends with a device synchronise); the
explorer's own work (tokenising, tables, JSON, HTML) stays on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from gradflow.explore.view import channel_view
from gradflow.losses import mlm_loss
from gradflow.models import load_model
from gradflow.runs.channels import channel_batch

WORDS = ("the progress of public credit is witnessed by a considerable rise of american stock abroad and the "
         "abundant fruits of another year have blessed our country with plenty and with commerce at home").split()


def sentence_of(loaded, n_tokens: int) -> str:
    """The longest prefix of WORDS that tokenizes to at most ``n_tokens`` tokens (special tokens included)."""
    words: list[str] = []
    for word in WORDS * 4:
        if len(loaded.tokenizer(" ".join([*words, word]))["input_ids"]) > n_tokens:
            break
        words.append(word)
    return " ".join(words)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--model", default="gradflow-mini-en")
    parser.add_argument("--device", default="cpu", help="torch device of the model (default cpu)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, device=args.device)
    text = sentence_of(loaded, args.tokens)
    n = len(loaded.tokenizer(text)["input_ids"])
    mask = [3, 9]
    batch = channel_batch(loaded, text, mask)

    def bare() -> None:
        with torch.enable_grad():
            emb = loaded.model.get_input_embeddings()
            out = loaded.model(**batch.to(args.device).model_inputs())
            torch.autograd.grad(mlm_loss(out.logits, batch.to(args.device)), [emb.weight])

    def view() -> None:
        channel_view(loaded, text, mask=mask)

    computed = channel_view(loaded, text, mask=mask)

    def payload() -> None:
        json.dumps(computed.payload(), allow_nan=False)

    try:
        from starlette.testclient import TestClient

        from gradflow.explore.server import create_app
        from gradflow.explore.service import ExploreConfig, ExploreService

        service = ExploreService(ExploreConfig(models=(args.model,), device=args.device), loader=lambda name: loaded)
        client = TestClient(create_app(service))
    except ImportError:
        client = None

    def http() -> None:
        response = client.post("/api/view", json={"model": args.model, "text": text, "mask": mask})
        assert response.status_code == 200, response.text

    page_bytes = len(computed.to_html().encode())

    def html() -> None:
        computed.to_html()

    modes = {"bare": bare, "view": view, "payload": payload, "html": html}
    if client is not None:
        modes["http"] = http
    times: dict[str, list[float]] = {m: [] for m in modes}
    for fn in modes.values():
        fn()  # warm-up
    for _ in range(args.rounds):
        for name, fn in modes.items():
            start = time.perf_counter()
            fn()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["bare"])
    print(f"{args.model} on {args.device}, {n} tokens, mask {mask}, {args.threads} threads, {os.cpu_count()} CPUs, "
          f"{args.rounds} rounds (median)")
    for name in modes:
        med = statistics.median(times[name])
        extra = f"   page {page_bytes / 1e6:.2f} MB" if name == "html" else ""
        print(f"  {name:8s} {1000 * med:8.1f} ms   {med / base:6.2f}x bare{extra}")
    if client is not None:
        verdict = "meets" if statistics.median(times["http"]) < 0.3 else "MISSES"
        print(f"  target: http < 300 ms -> {verdict}")


if __name__ == "__main__":
    main()
