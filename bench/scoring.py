"""lm-eval-style loglikelihood scoring on the embedded model: radixlang against transformers.

    python -m bench.scoring [--quick]

The traffic is what lm-eval-harness sends for a multiple-choice task with a 3-shot prompt: 60 items
(15 with --quick) x 4 continuations, each a loglikelihood request over context + continuation, all
sharing the 3-shot prefix (made here from templates; no dataset is downloaded).

- radixlang: each request as lm-eval's ``local-completions`` sends it (echo + logprobs from position 0,
  no new token: ``Engine.generate(logprob_start_len=0, max_new_tokens=0)``), ``--batch`` requests at a
  time in flight (lm-eval's concurrent batches), the cache flushed first so the prefix is computed once
  in the timed run; the continuation's loglikelihood is the sum of its tokens' input logprobs.
- transformers: lm-eval's ``hf`` backend on the same weights (float32), in its own process: requests
  sorted longest first, ``--batch`` of them right-padded into one forward, log_softmax over the
  continuation's positions.

Prints both wall times, the ratio, radixlang's cached prompt tokens and the largest loglikelihood
difference between the two; writes bench/results/scoring.json.
"""
from __future__ import annotations

import argparse
import multiprocessing
import random
import time

import torch

from bench.common import load_hf, threads, write_result

SUBJECTS = ["the river", "a copper wire", "the old library", "a glass of water", "the mountain road",
            "a paper kite", "the night train", "a wooden bridge", "the winter garden", "a small engine"]
VERBS = ["is heated", "is left in the sun", "is struck by lightning", "is painted blue", "is frozen overnight",
         "is weighed twice", "is measured at noon", "is moved north", "is cleaned with salt", "is cut in half"]
ANSWERS = ["it gets warmer", "it becomes heavier", "it stays the same", "it changes color", "it breaks apart",
           "it moves faster", "it shrinks slowly", "it turns to steam", "it loses its shape", "it grows brighter"]


def make_requests(num_items: int, tokenizer) -> tuple[list[tuple[list[int], list[int]]], int]:
    """[(context ids, continuation ids)] for num_items x 4 choices, and the shared prefix's token count."""
    rng = random.Random(0)

    def question() -> tuple[str, list[str], int]:
        q = f"Question: What happens when {rng.choice(SUBJECTS)} {rng.choice(VERBS)}?"
        choices = rng.sample(ANSWERS, 4)
        return q, choices, rng.randrange(4)

    shots = []
    for _ in range(3):
        q, choices, gold = question()
        shots.append(f"{q}\nAnswer: {choices[gold]}\n\n")
    prefix = "The following are questions about everyday physics.\n\n" + "".join(shots)
    requests = []
    for _ in range(num_items):
        q, choices, _ = question()
        ctx = tokenizer.encode(prefix + q + "\nAnswer:", add_special_tokens=False)
        for c in choices:
            requests.append((ctx, tokenizer.encode(" " + c, add_special_tokens=False)))
    return requests, len(tokenizer.encode(prefix, add_special_tokens=False))


def hf_loglikelihoods(folder: str, requests: list[tuple[list[int], list[int]]], batch: int, conn) -> None:
    """Child process: lm-eval's hf backend on these requests; sends (loglikelihoods, seconds)."""
    torch.set_num_threads(threads())
    model = load_hf(folder)
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i][0]) - len(requests[i][1]))
    out = [0.0] * len(requests)

    def run(idx: list[int]) -> None:
        rows = [(requests[i][0] + requests[i][1])[:-1] for i in idx]
        width = max(len(r) for r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.int64)
        for j, r in enumerate(rows):
            ids[j, :len(r)] = torch.tensor(r)
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits.float(), dim=-1)  # [batch, width, vocab] float32
        for j, i in enumerate(idx):
            ctx, cont = requests[i]
            pos = torch.arange(len(ctx) - 1, len(ctx) - 1 + len(cont))
            out[i] = float(logp[j, pos, torch.tensor(cont)].sum())

    run(order[:2])  # warm up
    t = time.perf_counter()
    for k in range(0, len(order), batch):
        run(order[k:k + batch])
    conn.send((out, time.perf_counter() - t))


def radixlang_loglikelihoods(engine, requests: list[tuple[list[int], list[int]]], batch: int
                             ) -> tuple[list[float], float, int, int]:
    """(loglikelihoods, seconds, cached prompt tokens, prompt tokens), batch requests in flight at a time."""
    engine.generate(input_ids=requests[0][0][:16], sampling_params={"max_new_tokens": 1})  # warm up
    engine.flush_cache()
    out: list[float] = []
    cached = total = 0
    t = time.perf_counter()
    for k in range(0, len(requests), batch):
        chunk = requests[k:k + batch]
        res = engine.generate(input_ids=[c + d for c, d in chunk], return_logprob=True, logprob_start_len=0,
                              sampling_params=[{"max_new_tokens": 0, "temperature": 0}] * len(chunk))
        for (ctx, cont), r in zip(chunk, res):
            lps = r["meta_info"]["input_token_logprobs"]
            out.append(sum(lp for lp, _, _ in lps[len(ctx):]))
            cached += r["meta_info"]["cached_tokens"]
            total += len(ctx) + len(cont)
    return out, time.perf_counter() - t, cached, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="15 items instead of 60")
    ap.add_argument("--batch", type=int, default=16, help="requests in flight / hf batch size (default 16)")
    args = ap.parse_args()
    from radixlang import Engine
    from radixlang.runtime.models.loader.model_loader import resolve_model_dir
    folder = resolve_model_dir(None)
    engine = Engine(max_total_tokens=32768, num_threads=threads())
    try:
        requests, prefix_len = make_requests(15 if args.quick else 60, engine.tokenizer)
        ours, t_ours, cached, total = radixlang_loglikelihoods(engine, requests, args.batch)
    finally:
        engine.shutdown()
    ctx = multiprocessing.get_context("spawn")  # transformers' OpenMP team apart from the engine's
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=hf_loglikelihoods, args=(folder, requests, args.batch, send))
    child.start()
    theirs, t_hf = recv.recv()
    child.join()
    diff = max(abs(a - b) for a, b in zip(ours, theirs))
    rows = {"requests": len(requests), "shared_prefix_tokens": prefix_len, "batch": args.batch,
            "radixlang_s": t_ours, "transformers_s": t_hf, "ratio": t_hf / t_ours,
            "cached_prompt_tokens": cached, "prompt_tokens": total, "max_loglikelihood_diff": diff}
    print(f"{len(requests)} loglikelihood requests ({prefix_len}-token shared prefix, batches of {args.batch}): "
          f"radixlang {t_ours:.2f} s, transformers {t_hf:.2f} s, ratio {t_hf / t_ours:.2f}x")
    print(f"cached prompt tokens {cached} of {total}; max |loglikelihood diff| {diff:.2e}")
    print("wrote", write_result("scoring", rows))


if __name__ == "__main__":
    main()
