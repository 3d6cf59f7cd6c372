"""Every workload on every system in one run: the paper-style comparison table.

    python -m bench.run_all [--quick] [--only NAME ...]

Prints programs/s, tokens/s, p50/p99 latency, prompt-token cache hit rate and each
system's throughput relative to radixlang; writes bench/results/latest.json and
bench/results/latest.png (normalized throughput per workload, radixlang = 1).
A workload that fails on a system (e.g. JSON where a system has no constrained
decoding) becomes an error row instead of stopping the run.

Each system runs in its own child process: two systems' torch (or llama.cpp) thread teams alive
in one process slow each other (libgomp stops spinning between parallel regions once it manages
more threads than there are cores: measured up to 2x on small matmuls), and a fresh process
gives every system the same clean start.
"""
from __future__ import annotations

import argparse
import functools
import multiprocessing
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tqdm import tqdm

from bench.common import RESULTS, write_result
from bench.systems import System, close, default_systems
from bench.workloads import Workload, all_workloads


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _missing(state: Any, outputs: tuple[str, ...]) -> str | None:
    """Why a finished state is unusable, or None: the program's error or a variable it did not produce."""
    err = state.error() if hasattr(state, "error") else None
    if err is not None:
        return str(err)
    for var in outputs:
        try:
            state[var]
        except Exception as e:  # a failed gen surfaces here
            return f"{var}: {e}"
    return None


def run_workload(workload: Workload, backend: Any, n: int, concurrency: int) -> dict[str, Any]:
    """Run n programs (concurrency at a time); the metrics row, or {"error": ...} if any program failed."""
    data = workload.dataset(n, 0)
    backend.flush_cache()
    before = backend.counters()
    latencies: list[float] = []

    def one(kwargs: dict[str, Any]) -> tuple[Any, float]:
        t = time.perf_counter()
        state = workload.program.run(backend=backend, **workload.sampling, **kwargs)
        return state, time.perf_counter() - t

    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(one, data))
    except Exception as e:  # the program body itself raised
        return {"error": f"{type(e).__name__}: {e}"}
    elapsed = time.perf_counter() - start
    for state, lat in results:
        why = _missing(state, workload.outputs)
        if why is not None:
            return {"error": why[:300]}
        latencies.append(lat)
    after = backend.counters()
    prompt = after.prompt_tokens - before.prompt_tokens
    return {"programs": n, "seconds": elapsed, "programs_s": n / elapsed,
            "tokens_s": (after.completion_tokens - before.completion_tokens) / elapsed,
            "p50_s": _percentile(latencies, 0.5), "p99_s": _percentile(latencies, 0.99),
            "hit_rate": (after.cached_tokens - before.cached_tokens) / max(prompt, 1),
            "states": [_outputs(state, workload.outputs) for state, _ in results[:2]]}


def _outputs(state: Any, outputs: tuple[str, ...]) -> dict[str, Any]:
    return {var: state[var] for var in outputs}


# one transformers program of each of these decodes 130-190 tokens at ~10 tok/s (15-19 s apiece):
# --quick leaves them to the full run
_QUICK_SKIPS = {"transformers": ("chat_long", "tree_of_thought", "skeleton_of_thought")}


def _runs(system: System, workload: Workload, quick: bool) -> bool:
    return system.runs(workload.name) and not (quick and workload.name in _QUICK_SKIPS.get(system.name, ()))


def _programs(workload: Workload, system: System, quick: bool) -> int:
    n = workload.quick_n if quick else workload.full_n
    return n if system.concurrency > 1 else max(1, n // 4)  # the serial baseline gets fewer, same prompts


# what every system's process imports: the fork server imports it once, each child starts from a copy
_PRELOAD = ["torch", "transformers", "radixlang.runtime.entrypoints.engine", "radixlang.lang", "bench.systems",
            "bench.peers",
            "bench.workloads", "llama_cpp", "outlines"]


@functools.cache
def _context() -> Any:
    """A fork server with the heavy imports done (missing ones are skipped): ~3-7 s less per system.

    The fork server itself runs no torch op, so no OpenMP team exists when it forks."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_system(system: System, workloads: list[Workload], model_dir: str, quick: bool | int):
    """Yield (workload name, metrics row) for each workload the system runs, measured in a child process.

    ``quick``: True/False picks each workload's quick_n/full_n programs; an int runs that many."""
    ctx = _context()
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_system_child, args=(system, [w.name for w in workloads], model_dir, quick, send),
                        daemon=True)
    child.start()
    send.close()
    try:
        while True:
            try:
                msg = recv.recv()
            except EOFError:  # the child died without a word (killed, out of memory)
                yield None, {"error": f"the {system.name} process exited with code {child.exitcode}"}
                return
            if msg is None:
                return
            yield msg
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()


def _system_child(system: System, names: list[str], model_dir: str, quick: bool | int, conn) -> None:
    try:
        by_name = {w.name: w for w in all_workloads()}
        backend = system.open(model_dir)
        try:
            for name in names:
                w = by_name[name]
                started = time.perf_counter()
                n = quick if not isinstance(quick, bool) else _programs(w, system, quick)
                row = run_workload(w, backend, n, system.concurrency)
                row["cell_s"] = time.perf_counter() - started
                conn.send((name, row))
        finally:
            close(backend)
    except Exception as e:  # the system could not start: every remaining cell reports it
        conn.send((None, {"error": f"{type(e).__name__}: {e}"}))
    conn.send(None)
    conn.close()


def run(workloads: list[Workload], systems: list[System], model_dir: str, quick: bool,
        out: str = "latest") -> dict[str, Any]:
    table: dict[str, dict[str, Any]] = {w.name: {} for w in workloads}
    with tqdm(total=len(workloads) * len(systems), desc="bench") as bar:
        for system in systems:
            mine = [w for w in workloads if _runs(system, w, quick)]
            bar.update(len(workloads) - len(mine))
            bar.set_postfix_str(system.name)
            for name, row in run_system(system, mine, model_dir, quick):
                for w in ([w.name for w in mine if system.name not in table[w.name]] if name is None else [name]):
                    table[w][system.name] = row
                    bar.update()
                # every finished cell is on disk: an interrupted run keeps what it measured
                write_result(out, {"quick": quick, "partial": True, "workloads": _with_ratios(table)})
    return _with_ratios(table)


def _with_ratios(table: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    for rows in table.values():
        base = rows.get("radixlang", {}).get("programs_s")
        for row in rows.values():
            if base and "programs_s" in row:
                row["ratio_to_radixlang"] = row["programs_s"] / base
    return table


def print_table(table: dict[str, dict[str, Any]]) -> None:
    head = f"{'workload':24s} {'system':20s} {'prog/s':>8s} {'tok/s':>8s} {'p50 s':>7s} {'p99 s':>7s} " \
           f"{'hit':>5s} {'radix/x':>8s}"
    print(head)
    print("-" * len(head))
    for name, rows in table.items():
        for system, row in rows.items():
            if "error" in row:
                print(f"{name:24s} {system:20s} ERROR: {row['error'][:80]}")
                continue
            speedup = 1 / row["ratio_to_radixlang"] if row.get("ratio_to_radixlang") else float("nan")
            print(f"{name:24s} {system:20s} {row['programs_s']:8.2f} {row['tokens_s']:8.1f} {row['p50_s']:7.2f} "
                  f"{row['p99_s']:7.2f} {row['hit_rate']:5.2f} {speedup:8.2f}")


def markdown_table(table: dict[str, dict[str, Any]], systems: list[str]) -> str:
    """The README table: radixlang's programs/s and hit rate, then how many times faster it is than each system."""
    others = [s for s in systems if s != "radixlang"]
    lines = ["| workload | radixlang programs/s | hit rate | " + " | ".join(f"vs {s}" for s in others) + " |",
             "|---" * (3 + len(others)) + "|"]
    for name, rows in table.items():
        base = rows.get("radixlang", {})
        if "programs_s" not in base:
            continue
        cells = []
        for s in others:
            row = rows.get(s)
            if row is None:
                cells.append("not run")
            elif "error" in row:
                cells.append("n/a (" + row["error"][:60].replace("|", "/") + ")")
            else:
                cells.append(f"{1 / row['ratio_to_radixlang']:.1f}x")
        lines.append(f"| {name} | {base['programs_s']:.2f} | {base['hit_rate']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(table: dict[str, dict[str, Any]], systems: list[str], out: str = "latest") -> None:
    """Normalized throughput bars (radixlang = 1), one group per workload, like the paper's figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(table)
    width = 0.8 / len(systems)
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(names)), 4))
    for i, system in enumerate(systems):
        values = [table[n].get(system, {}).get("ratio_to_radixlang", 0.0) for n in names]
        ax.bar([x + i * width for x in range(len(names))], values, width, label=system)
    ax.set_xticks([x + width * (len(systems) - 1) / 2 for x in range(len(names))], names, rotation=30, ha="right")
    ax.set_ylabel("throughput / radixlang")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(RESULTS / f"{out}.png", dpi=120)


# the bf16 Engine is lossy and opt-in; quick mode also leaves out the HTTP server, which ran within
# 1.0-1.2x of the Engine in full runs and costs a minute (its start-up and a second pass over every workload)
_NOT_BY_DEFAULT = {False: ("radixlang_bf16",), True: ("radixlang_bf16", "radixlang_server")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="few programs per workload (under 5 minutes)")
    ap.add_argument("--only", nargs="*", help="workload names to run (default: all)")
    ap.add_argument("--concurrency", type=int, default=32, help="programs in flight for the radixlang systems")
    ap.add_argument("--systems", nargs="*", help="system names to run (default: all that can run here but "
                                                   "radixlang_bf16, and radixlang_server with --quick)")
    ap.add_argument("--out", default="latest", help="results name: bench/results/NAME.json and NAME.png")
    args = ap.parse_args()
    from radixlang.runtime.models.loader.model_loader import resolve_model_dir
    workloads = [w for w in all_workloads() if not args.only or w.name in args.only]
    systems = [s for s in default_systems(args.concurrency)
               if (s.name in args.systems if args.systems else s.name not in _NOT_BY_DEFAULT[args.quick])]
    if not args.systems:
        print("not run (name them in --systems to add them):", ", ".join(_NOT_BY_DEFAULT[args.quick]))
    table = run(workloads, systems, resolve_model_dir(None), args.quick, args.out)
    print_table(table)
    print(markdown_table(table, [s.name for s in systems]))
    print("wrote", write_result(args.out, {"quick": args.quick, "partial": False, "systems": [s.name for s in systems],
                                           "workloads": table}))
    try:
        plot(table, [s.name for s in systems], args.out)
        print("wrote", RESULTS / f"{args.out}.png")
    except ImportError:
        print("matplotlib not installed: no chart")


if __name__ == "__main__":
    main()
