"""The decode attention kernels alone, at a preset's decode shapes: torch SDPA (cuDNN on an H100, the
engine's `attention=sdpa`), the Triton split-KV kernel (generation/decode_attention.py) over a grid of
its `KernelConfig`s, and, with --previous DIR, the kernel of an earlier checkout (DIR holds its tree,
e.g. `git archive <commit> | tar -x -C .prev`).

    python scripts/bench/decode_attention.py --presets embedded,qwen1_5b [--previous .prev]   # one GPU

Workload per preset: its GRPO batch (prompts x n sequences) and --few sequences, its heads and head size, a cache of
P + R positions per sequence; every sequence at the same position p, for p at a quarter, half and
the end of the response (the decode step's cache grows from P to P + R). Each kernel's call is
captured 20 times in one CUDA graph (as the engine replays it) and the graph replayed 10 times;
microseconds per call, and the bytes of K and V it must read (sequences x K/V heads x (p + 1) x
head size x 2 x 2 bytes) over that time as a share of the measured copy bandwidth. Every output is
checked against SDPA's (max abs difference < 2e-2, else the config is reported as failing).

Writes decode_attention.md and .json under --out (default bench_out/decode_attention).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import itertools
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from grpo_step import measure_hardware  # noqa: E402
from grpo_step_lib import PRESETS  # noqa: E402
from aligner_ext.generation import decode_attention  # noqa: E402
from aligner_ext.generation.decoder import additive_mask, attend_decode  # noqa: E402

CALLS_PER_GRAPH, REPLAYS = 20, 10
GRID = {"splits": (0, 64, 128, 256), "blocks": (32, 64, 128), "warps": (2, 4, 8), "stages": (1, 2, 3)}


def graph_time(fn) -> float:
    """Seconds per call of `fn`, replayed from a CUDA graph of CALLS_PER_GRAPH calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (REPLAYS * CALLS_PER_GRAPH)


def module_of_tree(root: Path, relative: str):
    """The module at `relative` (e.g. "aligner_ext/generation/sampler.py") of the checkout under
    `root`, loaded apart from this tree's."""
    spec = importlib.util.spec_from_file_location(f"previous_{Path(relative).stem}", root / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def configs(grid: dict[str, tuple[int, ...]]) -> list[decode_attention.KernelConfig]:
    return [decode_attention.KernelConfig(split, block, warps, stages)
            for split, block, warps, stages in itertools.product(*(grid[key] for key in ("splits", "blocks", "warps", "stages")))
            if split == 0 or block <= split]


def sweep(preset, bandwidth: float, previous, batch: int, grid: dict[str, tuple[int, ...]]) -> dict:
    heads, kv_heads = preset.num_heads, preset.num_kv_heads
    dim = preset.hidden_size // heads
    length = preset.prompt_length + preset.response_length
    torch.manual_seed(0)
    keys = torch.randn(batch, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    q = torch.randn(batch, 1, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # as the decoder's
    scale = dim**-0.5
    results = {"shape": {"sequences": batch, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "cache": length},
               "positions": {}}
    for position in (preset.prompt_length + preset.response_length // 4, preset.prompt_length + preset.response_length // 2,
                     length - 1):
        positions = torch.full((batch,), position, device="cuda", dtype=torch.long)
        attended = min(length, -(-(position + 1) // 128) * 128)  # the engine's sdpa path: a multiple of 128
        mask = additive_mask(positions, attended, keys.dtype)
        kv_bytes = batch * kv_heads * (position + 1) * dim * 2 * 2
        reference = attend_decode(q, keys[:, :, :attended], values[:, :, :attended], mask, scale)
        rows = {}

        def measure(name, fn):
            try:
                error = (fn().float() - reference.float()).abs().max().item()
                seconds = graph_time(fn) if error < 2e-2 else None
            except Exception as exc:  # noqa: BLE001 -- a config Triton cannot build is reported, not fatal
                rows[name] = {"error": repr(exc)[:200]}
                return
            rows[name] = {"us": seconds * 1e6 if seconds else None, "max_abs_diff": error,
                          "bandwidth_share": kv_bytes / seconds / bandwidth if seconds else None}

        measure("sdpa", lambda: attend_decode(q, keys[:, :, :attended], values[:, :, :attended], mask, scale))
        if previous is not None:
            measure("previous", lambda: previous(q, keys[:, :, :attended], values[:, :, :attended], positions, scale))
        measure("auto", lambda: decode_attention.attend_decode_triton(q, keys, values, positions, scale))
        for config in configs(grid):  # the engine's triton path passes the whole cache: splits past p read nothing
            measure(str(tuple(config)), lambda config=config: decode_attention.attend_decode_triton(
                q, keys, values, positions, scale, config))
        results["positions"][position] = {"kv_bytes": kv_bytes, "rows": rows}
        best = min((row["us"], name) for name, row in rows.items() if row.get("us"))
        print(f"{preset.name} x{batch} p={position}: sdpa {rows['sdpa'].get('us') or 0:.1f} us, best {best[1]} {best[0]:.1f} us",
              flush=True)
    # Rank the kernels by their summed time over the three positions (the step's mean cache length).
    names = [name for name in results["positions"][length - 1]["rows"]
             if all(r["rows"].get(name, {}).get("us") for r in results["positions"].values())]
    total = {name: sum(r["rows"][name]["us"] for r in results["positions"].values()) for name in names}
    results["ranking"] = sorted(total.items(), key=lambda item: item[1])
    return results


def render(report: dict) -> str:
    lines = [f"# Decode attention kernels ({report['date']})", "", f"`{report['command']}`", "",
             f"{report['hardware'].get('device_name', '')}, copy bandwidth "
             f"{report['hardware']['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write)", ""]
    for name, result in report["presets"].items():
        shape = result["shape"]
        positions = list(result["positions"])
        lines += [f"## {name}: {shape['heads']} / {shape['kv_heads']} heads of "
                  f"{shape['head_dim']}, cache {shape['cache']}", "",
                  "| kernel | " + " | ".join(f"p = {p}: us (share of bandwidth)" for p in positions) + " | sum us |",
                  "| --- |" + " --- |" * (len(positions) + 1)]
        shown = dict(result["ranking"][:12])
        for special in ("sdpa", "previous", "auto"):
            if special in dict(result["ranking"]):
                shown[special] = dict(result["ranking"])[special]
        for kernel, total in sorted(shown.items(), key=lambda item: item[1]):
            cells = [f"{result['positions'][p]['rows'][kernel]['us']:.1f} "
                     f"({result['positions'][p]['rows'][kernel]['bandwidth_share']:.0%})" for p in positions]
            lines.append(f"| {kernel} | " + " | ".join(cells) + f" | {total:.1f} |")
        failing = sorted({k for p in positions for k, row in result["positions"][p]["rows"].items() if not row.get("us")})
        if failing:
            lines += ["", f"Failing or unbuildable: {', '.join(failing)}"]
        lines.append("")
    lines.append("Kernel names: (split, block, warps, stages) of `KernelConfig`; split 0: one program per sequence.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="embedded,qwen1_5b")
    parser.add_argument("--previous", type=Path, default=None, help="an earlier checkout's tree, for its kernel")
    parser.add_argument("--few", type=int, default=8, help="a second, small batch (continuous batching's tail)")
    parser.add_argument("--out", type=Path, default=HERE.parent.parent / "bench_out" / "decode_attention")
    for key, default in GRID.items():
        parser.add_argument(f"--{key}", default=",".join(map(str, default)), help=f"KernelConfig {key} to try")
    args = parser.parse_args()
    grid = {key: tuple(int(value) for value in getattr(args, key).split(",")) for key in GRID}
    hardware = measure_hardware("cuda")
    previous = (module_of_tree(args.previous, "aligner_ext/generation/decode_attention.py").attend_decode_triton
                if args.previous else None)
    report = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv), "hardware": hardware,
              "presets": {}}
    for name in args.presets.split(","):
        preset = PRESETS[name]
        for batch in (preset.prompts * preset.n, args.few):
            report["presets"][f"{name}, {batch} sequences"] = sweep(preset, hardware["copy_bytes_per_s"], previous, batch,
                                                                     grid)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_attention.json").write_text(json.dumps(report, indent=2))
    text = render(report)
    (args.out / "decode_attention.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
