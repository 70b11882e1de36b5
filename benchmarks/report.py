"""The throughput report as tables: one per workload (print_report), and with several
workloads one row per engine across them (print_side_by_side)."""

from __future__ import annotations


def print_report(report: dict) -> None:
    lens = "prompts {}-{}, outputs {}-{} tokens".format(*report["prompt_lens"], *report["output_lens"])
    sampling = report["sampling"] if report["sampling"] == "greedy" else "sampled ({})".format(
        ", ".join(f"{k} {v}" for k, v in report["sampling"].items()))
    print(f"workload {report['workload']}: {report['num_requests']} requests, {lens}, {sampling}, "
          f"{report['model']}, {report['device']}, {report['dtype']}, torch {report['torch']}\n")
    cuda = not report["device"].startswith("CPU")
    measured = "peak allocated" if cuda else "peak RSS"
    print(f"| engine | output tokens | seconds | tok/s | vs HF generate | {measured} (GiB) | of it, KV pool: "
          "allocated / used at peak (GiB) | note |")
    print("|---|---|---|---|---|---|---|---|")
    for row in report["results"]:
        ratio = f"{row['ratio_to_hf_generate']:.2f}x" if row["ratio_to_hf_generate"] else "-"
        tps = f"{row['tok_per_s']:,.0f}" if row["tok_per_s"] else "-"
        pool = f"{row['kv_pool_gib']:.3g} / {row['kv_used_peak_gib']:.3g}" if "kv_pool_gib" in row else "-"
        print(f"| {row['engine']} | {row['output_tokens']:,} | {row['seconds']:.1f} | {tps} | {ratio} | "
              f"{row['peak_memory_gib']:.2f} | {pool} | {row['note']} |")
    print(f"\n{measured}: " + ("torch's peak allocated device memory" if cuda else "the process's peak resident "
                                "memory (VmHWM)") + " during the run. nanokv allocates its KV pool up front "
          "(gpu_memory_utilization or kv_cache_memory_bytes), so its peak holds the whole pool, used or not; "
          "HF's cache grows with its batch and is inside its peak.")
    budget = report.get("kv_cache_memory_bytes")
    for row in report["results"]:
        if "kv_capacity_tokens" in row:
            print(f"\n{row['engine']}: KV {row['kv_cache_dtype']}, {row['kv_bytes_per_token']:,} bytes per token: "
                  f"the pool holds {row['kv_capacity_tokens']:,} tokens"
                  + (f" in {budget / 2**30:.3g} GiB" if budget else "")
                  + f"; peak {row['peak_running_seqs']} concurrent sequences, "
                  f"{row['kv']['num_preemptions']} preemptions")
    nano = next((row for row in report["results"] if row["engine"] == "nanokv"), None)
    if nano is not None:
        rf = report["roofline"]
        print(f"\nnanokv {nano['kv_summary']}")
        print(f"nanokv steps {nano['steps']} ({report['ms_per_step']:.1f} ms each), backend {nano['backend']}, "
              f"time outside the model forward {report['outside_forward_percent']:.1f}%")
        print(f"roofline ({rf['kind']}): floor {rf['floor_seconds']:.1f} s; nanokv reaches {rf['percent']:.0f}% of it")


def print_side_by_side(reports: list[dict]) -> None:
    """One row per engine, one column group per workload."""
    print("\n| engine | " + " | ".join(f"{r['workload']}: tok/s | vs HF generate" for r in reports) + " |")
    print("|---|" + "---|---|" * len(reports))
    engines = list(dict.fromkeys(row["engine"] for r in reports for row in r["results"]))
    for engine in engines:
        cells = []
        for r in reports:
            row = next((x for x in r["results"] if x["engine"] == engine), None)
            ok = row is not None and row["tok_per_s"]
            cells += [f"{row['tok_per_s']:,.0f}" if ok else "-",
                      f"{row['ratio_to_hf_generate']:.2f}x" if ok and row["ratio_to_hf_generate"] else "-"]
        print(f"| {engine} | " + " | ".join(cells) + " |")
