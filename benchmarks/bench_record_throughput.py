"""Throughput of ``gradflow record`` (tokens/s) on a bert-base-shaped model, per dtype and recording mode.

Builds a randomly initialised BertForMaskedLM of the bert-base shape (12 layers, hidden 768, 12
heads, FFN 3072; seeded) with the embedded ``gradflow-mini-en`` tokenizer, saves it to a temporary
folder, and records the committed sample (repeated 100 times: 2,400 windows of up to 128 tokens) with
``record_corpus`` in this process: per dtype and mode (``norms``: ``--norms-only``; ``full``: with
the per-role sublayer split), one short run of ``--short`` sequences and one of ``--limit``. The
rate is the difference of the two: (tokens_long - tokens_short) / (wall_long - wall_short), so
loading the model and the first batches' warm-up are not counted. Not a test: numbers are
printed, never asserted.

    python -m benchmarks.bench_record_throughput --device cuda
    python -m benchmarks.bench_record_throughput --device cpu --dtypes float32 --limit 64 --short 16 --layers 2
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

from gradflow.models.loading import embedded_model_dir
from gradflow.runs.record import RecordConfig, default_texts, record_corpus


def save_base_shaped(folder: Path, layers: int, seed: int = 0) -> None:
    """A seeded random BertForMaskedLM (hidden 768, 12 heads, FFN 3072, ``layers`` blocks) and the mini tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir("gradflow-mini-en"))
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=768, num_hidden_layers=layers, num_attention_heads=12,
                        intermediate_size=3072, max_position_embeddings=512)
    BertForMaskedLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def timed_record(model: str, texts: Path, out: Path, limit: int, args: argparse.Namespace, dtype: str,
                 full: bool) -> tuple[int, int, float]:
    """(sequences, tokens, wall s) of one recording, model loading included."""
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    summary = record_corpus(RecordConfig(out=str(out), model=model, texts=str(texts), limit=limit,
                                         batch_size=args.batch_size, device=args.device, dtype=dtype,
                                         sublayers=full, quiet=True, overwrite=True))
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    return summary.sequences, summary.tokens, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    p.add_argument("--limit", type=int, default=1024, help="sequences of the long run")
    p.add_argument("--short", type=int, default=128, help="sequences of the short run (subtracted)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--layers", type=int, default=12)
    args = p.parse_args()
    if args.short >= args.limit:
        raise SystemExit(f"--short ({args.short}) must be below --limit ({args.limit}).")
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(f"device={args.device} ({name}) torch={torch.__version__} layers={args.layers} hidden=768 "
          f"batch={args.batch_size} T=128 short={args.short} long={args.limit}")
    print(f"{'dtype':<10}{'mode':<7}{'sequences':>10}{'tokens':>10}{'wall s':>9}{'tokens/s':>11}{'sequences/s':>13}")
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "bert-base-shaped"
        save_base_shaped(model, args.layers)
        texts = Path(tmp) / "corpus.txt"
        texts.write_text(Path(default_texts()).read_text(encoding="utf-8") * 100, encoding="utf-8")
        timed_record(str(model), texts, Path(tmp) / "warm-up", 8, args, args.dtypes[0], True)
        for dtype in args.dtypes:
            for mode in ("norms", "full"):
                s_seq, s_tok, s_wall = timed_record(str(model), texts, Path(tmp) / "short", args.short, args, dtype,
                                                    mode == "full")
                l_seq, l_tok, l_wall = timed_record(str(model), texts, Path(tmp) / "long", args.limit, args, dtype,
                                                    mode == "full")
                if l_seq < args.limit:
                    raise SystemExit(f"the corpus ran out at {l_seq} sequences: lower --limit below {l_seq}.")
                tokens, seqs, wall = l_tok - s_tok, l_seq - s_seq, l_wall - s_wall
                if wall <= 0:  # the long run was not slower than the short one: noise dominates
                    print(f"{dtype:<10}{mode:<7}{seqs:>10}{tokens:>10}{wall:>9.2f}  no rate: raise --limit", flush=True)
                    continue
                print(f"{dtype:<10}{mode:<7}{seqs:>10}{tokens:>10}{wall:>9.2f}{tokens / wall:>11.0f}{seqs / wall:>13.1f}",
                      flush=True)
                print(json.dumps({"dtype": dtype, "mode": mode, "sequences": seqs, "tokens": tokens,
                                  "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1)}), flush=True)


if __name__ == "__main__":
    main()
