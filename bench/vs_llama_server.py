"""radixlang's server against llama.cpp's own C++ server, both over HTTP, on the embedded GGUF.

    python -m bench.llama_server --build      # once (~15 min on 2 cores)
    python -m bench.vs_llama_server [--quick]

Each system is a fresh server process run alone, with the same threads, greedy, on the same token ids
(the SmolLM2 tokenizer): llama-server with ``--parallel 32`` slots (continuous batching, ``cache_prompt``),
radixlang's ``launch_server`` with its defaults (the GGUF's own quantized blocks, the radix cache).
Workloads:

- ``single``: one request, 128 new tokens (EOS ignored); decode tokens/s, best of the repeats.
- ``extract``: one request whose answer copies its prompt (a document to repeat), up to 160 new tokens
  to its natural end; tokens/s. Here the speculative systems run too: radixlang with
  ``--speculative-algorithm ngram`` and llama-server with ``--spec-type ngram-simple``.
- ``shared_prefix``: 32 requests at once on a ~613-token few-shot prefix, 16 new tokens each, two rounds
  with different questions; wall seconds.
- ``chats``: 8 chats x 4 turns, the 8 at a time, 24 new tokens a turn (each turn resends the history);
  wall seconds.

Prints every figure and each ratio against llama-server (and against llama-server's own n-gram
speculation for ``extract``); writes bench/results/vs_llama_server.json (and .png with matplotlib).
"""
from __future__ import annotations

import argparse
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from bench.common import RESULTS, threads, write_result

DOC = ("Invoice 2291 from Acme Tools Ltd, 14 Baker Street, Leeds LS1 4AB. Date: 2025-11-03. Items: 3 claw "
       "hammers at 12.50 each, 2 panel saws at 30.00 each, 1 cordless drill at 89.99, 4 boxes of wood screws "
       "at 3.25 each. Subtotal 222.49, VAT 44.50, total 266.99. Payment within 30 days to account "
       "40-12-76 31926819. Contact: Jane Miller, accounts, jane.miller@acmetools.example, phone 0113 496 "
       "0321. Deliver to the rear entrance, Unit 7, Riverside Park, Hull HU2 8TD, between 9am and 4pm.")
FACTS = [("France", "Paris"), ("Japan", "Tokyo"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Canada", "Ottawa"),
         ("Egypt", "Cairo"), ("Norway", "Oslo"), ("Chile", "Santiago"), ("India", "New Delhi"),
         ("Spain", "Madrid"), ("Poland", "Warsaw"), ("Ghana", "Accra"), ("Iran", "Tehran"),
         ("Cuba", "Havana"), ("Italy", "Rome"), ("Mexico", "Mexico City")]
QUESTIONS = ["Portugal", "Brazil", "Germany", "Greece", "Turkey", "Vietnam", "Sweden", "Austria", "Nigeria",
             "Morocco", "Ireland", "Finland", "Denmark", "Hungary", "Thailand", "Argentina", "Colombia",
             "Ukraine", "Romania", "Belgium", "Nepal", "Iraq", "Israel", "Jordan", "Qatar", "Oman", "Mali",
             "Chad", "Laos", "Fiji", "Malta", "Cyprus", "Latvia", "Estonia", "Serbia", "Croatia", "Albania",
             "Bolivia", "Uruguay", "Panama", "Jamaica", "Haiti", "Senegal", "Sudan", "Yemen", "Syria",
             "Lebanon", "Kuwait", "Bhutan", "Mongolia", "Georgia", "Armenia", "Iceland", "Slovakia", "Belarus",
             "Ecuador", "Paraguay", "Honduras", "Somalia", "Zambia", "Uganda", "Rwanda", "Gabon", "Togo"]
TOPICS = ["a lighthouse keeper", "the history of tea", "how bees talk", "a trip to the mountains",
          "learning the violin", "why the sky is blue", "a robot that paints", "the first day at school"]


class Client:
    """One system's server and how to send it a greedy completion of token ids."""

    def __init__(self, name: str, url: str, close: Callable[[], None], native: bool) -> None:
        self.name, self.url, self.close, self.native = name, url, close, native

    def complete(self, ids: list[int], n: int, *, ignore_eos: bool) -> int:
        """Generate up to ``n`` tokens after ``ids``; returns how many were generated."""
        if self.native:
            body: dict[str, Any] = {"input_ids": ids, "sampling_params": {
                "temperature": 0, "max_new_tokens": n, "ignore_eos": ignore_eos}}
            return int(_post(self.url + "/generate", body)["meta_info"]["completion_tokens"])
        body = {"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1, "repeat_penalty": 1.0,
                "cache_prompt": True, "ignore_eos": ignore_eos, "stream": False}
        out = _post(self.url + "/completion", body)
        return int((out.get("timings") or {}).get("predicted_n", out.get("tokens_predicted", 0)))


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1200) as r:
        return json.loads(r.read())


def open_system(name: str) -> Client:
    from radixlang.lang.backends.runtime import Runtime
    from radixlang.runtime.models.loader.model_loader import default_model_path

    if name.startswith("llama-server"):
        from bench.llama_server import LlamaServer
        extra = ["--spec-type", "ngram-simple"] if name.endswith("+ngram") else []
        server = LlamaServer(default_model_path(), parallel=32, threads=threads(), ctx_per_slot=2048,
                             extra_args=extra)
        return Client(name, server.url, server.close, native=False)
    kw: dict[str, Any] = {"speculative_algorithm": "ngram"} if name.endswith("+ngram") else {}
    rt = Runtime(max_total_tokens=65536, num_threads=threads(), log_level="warning", **kw)
    return Client(name, rt.url, rt.shutdown, native=True)


# ---- workloads: each returns {"value": ..., "unit": ...} --------------------------------------------

def _chat(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def single(c: Client, tok: Any, repeats: int) -> dict[str, Any]:
    ids = _chat(tok, [{"role": "user", "content": "Write a long story about a lighthouse keeper."}])
    c.complete(ids, 8, ignore_eos=True)  # warm-up
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        n = c.complete(ids, 128, ignore_eos=True)
        best = max(best, n / (time.perf_counter() - t))
    return {"value": best, "unit": "tok/s", "higher_is_better": True}


def extract(c: Client, tok: Any, repeats: int) -> dict[str, Any]:
    ids = _chat(tok, [{"role": "user", "content": f"Repeat the following text exactly, word for word.\n\n{DOC}"}])
    c.complete(ids[:-8], 4, ignore_eos=True)  # warm-up (not the whole prompt: each run prefills its tail)
    best, tokens = 0.0, 0
    for _ in range(repeats):
        t = time.perf_counter()
        tokens = c.complete(ids, 160, ignore_eos=False)
        best = max(best, tokens / (time.perf_counter() - t))
    return {"value": best, "unit": "tok/s", "higher_is_better": True, "tokens": tokens}


def shared_prefix(c: Client, tok: Any, repeats: int) -> dict[str, Any]:
    shots = "\n".join(f"Q: What is the capital of {a}?\nA: The capital of {a} is {b}. It is a city in {a}, "
                      f"and many people who live in {a} have visited {b}." for a, b in FACTS)
    c.complete(tok.encode("Q: warm up", add_special_tokens=False), 4, ignore_eos=True)
    t = time.perf_counter()
    for r in range(2):
        prompts = [tok.encode(f"{shots}\nQ: What is the capital of {q}?\nA:", add_special_tokens=False)
                   for q in QUESTIONS[32 * r:32 * r + 32]]
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda ids: c.complete(ids, 16, ignore_eos=True), prompts))
    return {"value": time.perf_counter() - t, "unit": "s", "higher_is_better": False,
            "prefix_tokens": len(tok.encode(shots, add_special_tokens=False))}


def chats(c: Client, tok: Any, repeats: int) -> dict[str, Any]:
    c.complete(tok.encode("warm up", add_special_tokens=False), 4, ignore_eos=True)
    asks = ["Tell me about {}.", "Why is that interesting?", "Give me one more detail.", "Sum it up in a line."]

    def chat(topic: str) -> None:
        history: list[dict[str, str]] = []
        for turn in range(4):
            history.append({"role": "user", "content": asks[turn].format(topic)})
            ids = _chat(tok, history)
            n = c.complete(ids, 24, ignore_eos=True)
            # the reply's text is not needed to load the server the same way: a fixed stand-in of n tokens
            history.append({"role": "assistant", "content": " ".join(["word"] * n)})

    t = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(chat, TOPICS))
    return {"value": time.perf_counter() - t, "unit": "s", "higher_is_better": False}


WORKLOADS = {"single": single, "extract": extract, "shared_prefix": shared_prefix, "chats": chats}
PLAN = {"llama-server": list(WORKLOADS), "radixlang": list(WORKLOADS), "llama-server+ngram": ["extract"],
        "radixlang+ngram": ["extract"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one timed repeat instead of three")
    ap.add_argument("--only", nargs="*", default=None, help="systems to run (default: all)")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from bench.llama_server import binary_path
    from radixlang.runtime.models.loader.model_loader import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    repeats = 1 if args.quick else 3
    results: dict[str, dict[str, Any]] = {}
    for name, workloads in PLAN.items():
        if args.only and name not in args.only:
            continue
        if name.startswith("llama-server") and not binary_path().exists():
            print(f"skipping {name}: no binary at {binary_path()} (python -m bench.llama_server --build)")
            continue
        client = open_system(name)
        try:
            for w in workloads:
                results.setdefault(w, {})[name] = WORKLOADS[w](client, tok, repeats)
                print(f"{name:20s} {w:14s} {results[w][name]['value']:8.2f} {results[w][name]['unit']}", flush=True)
        finally:
            client.close()
    ratios = _ratios(results)
    for line in ratios:
        print(line)
    path = write_result("vs_llama_server", {"threads": threads(), "results": results, "ratios": ratios})
    print("wrote", path)
    _chart(results)


def _ratios(results: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    for w, rows in results.items():
        for base in ("llama-server", "llama-server+ngram"):
            if base not in rows:
                continue
            for name, row in rows.items():
                if name.startswith("llama-server"):
                    continue
                b = rows[base]["value"]
                ratio = row["value"] / b if row["higher_is_better"] else b / row["value"]
                lines.append(f"{w}: {name} vs {base}: {ratio:.2f}x")
    return lines


def _chart(results: dict[str, dict[str, Any]]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart")
        return
    names = sorted({n for rows in results.values() for n in rows})
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        xs, ys = [], []
        for i, (w, rows) in enumerate(results.items()):
            if name in rows and "llama-server" in rows:
                b, v = rows["llama-server"]["value"], rows[name]["value"]
                xs.append(i + k * width)
                ys.append(v / b if rows[name]["higher_is_better"] else b / v)
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(results))], list(results))
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_yscale("log")  # shared_prefix is ~20x, single ~1-2x: a linear axis flattens the rest
    ax.set_ylabel("speed relative to llama-server (log)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "vs_llama_server.png", dpi=120)
    print("wrote", RESULTS / "vs_llama_server.png")


if __name__ == "__main__":
    main()
