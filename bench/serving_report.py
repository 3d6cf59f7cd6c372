"""Metrics, the comparison table and the chart for bench.serving."""
from __future__ import annotations

from pathlib import Path
from typing import Any

# metric -> True when larger is better (throughputs), False for latencies
RATIO_METRICS = {"request_throughput": True, "input_token_throughput": True, "output_token_throughput": True,
                 "ttft_p50_ms": False, "ttft_p99_ms": False, "itl_p50_ms": False, "itl_p99_ms": False,
                 "e2e_p50_ms": False, "e2e_p99_ms": False}


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _ms(name: str, values: list[float]) -> dict[str, float]:
    mean = sum(values) / len(values) if values else float("nan")
    return {f"{name}_mean_ms": 1000 * mean, f"{name}_p50_ms": 1000 * percentile(values, 0.5),
            f"{name}_p99_ms": 1000 * percentile(values, 0.99)}


def summarize(results: list[dict[str, Any]], duration: float, cache_hit_rate: float) -> dict[str, Any]:
    ok = [r for r in results if r["ok"]]
    input_tokens = sum(r["prompt_len"] for r in ok)
    output_tokens = sum(r["output_len"] for r in ok)
    return {"completed": len(ok), "failed": len(results) - len(ok),
            "errors": [r["error"] for r in results if not r["ok"]][:5],
            "duration_s": duration, "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
            "request_throughput": len(ok) / duration, "input_token_throughput": input_tokens / duration,
            "output_token_throughput": output_tokens / duration, "cache_hit_rate": cache_hit_rate,
            **_ms("ttft", [r["ttft"] for r in ok if r["ttft"] is not None]),
            **_ms("itl", [x for r in ok for x in r["itl"]]),
            **_ms("e2e", [r["e2e"] for r in ok])}


def ratios(with_cache: dict[str, Any], without: dict[str, Any]) -> dict[str, float]:
    """How many times better the radix cache run is: throughput over throughput, latency under latency."""
    out = {}
    for name, larger_better in RATIO_METRICS.items():
        a, b = with_cache[name], without[name]
        num, den = (a, b) if larger_better else (b, a)
        out[name] = num / den if den and den == den and num == num else float("nan")
    return out


def print_comparison(result: dict[str, Any]) -> None:
    runs = result["runs"]
    names = list(runs)
    print(f"{'metric':26s}" + "".join(f"{n:>16s}" for n in names) + (f"{'cache x':>10s}" if "ratios" in result else ""))
    for metric in ("completed", "failed", "duration_s", *RATIO_METRICS, "cache_hit_rate"):
        row = f"{metric:26s}" + "".join(f"{runs[n][metric]:16.2f}" for n in names)
        if metric in result.get("ratios", {}):
            row += f"{result['ratios'][metric]:9.2f}x"
        print(row)
    for metric, ratio in result.get("ratios_vs_llama_server", {}).items():
        print(f"radix_cache vs llama_server, {metric}: {ratio:.2f}x")
    for n in names:
        for err in runs[n]["errors"]:
            print(f"[{n}] error: {err}")


def plot(result: dict[str, Any], path: Path) -> None:
    """Throughput and latency bars, one colour per run. Raises ImportError without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = result["runs"]
    panels = [("tokens/s", ["input_token_throughput", "output_token_throughput"]),
              ("ms", ["ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms"])]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(runs)
    for ax, (unit, metrics) in zip(axes, panels):
        for i, (name, run) in enumerate(runs.items()):
            ax.bar([x + i * width for x in range(len(metrics))], [run[m] for m in metrics], width, label=name)
        ax.set_xticks([x + width * (len(runs) - 1) / 2 for x in range(len(metrics))], metrics, rotation=30, ha="right")
        ax.set_ylabel(unit)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
