"""Peak memory and time of the HF <-> Megatron converters (tools/convert_*.py), each direction in a
fresh process. Writes JSON.

    python benchmarks/convert_memory.py [--out benchmarks/results/convert_memory_cpu.json]

Three models, random weights in float32 made by tools/make_tiny_model.py: tiny-qwen2 (180k
parameters: the processes' footprint without the model), a ~155M-parameter Qwen2 (hidden 1024,
8 layers, FFN 2816, 16 heads / 2 KV groups, vocabulary 32768, untied) and the same with 24 layers
(~331M: the same largest tensor, 2.1x the bytes). For each: HF -> Megatron
(``--tp 1 --pp 1``), then Megatron -> HF, each run ``--repeats`` times as a ``subprocess`` with
``OMP_NUM_THREADS=1``; the child's peak resident set size is ``ru_maxrss`` from ``os.wait4``. The
peak varies from run to run by up to ~60 MiB of anonymous memory (seen with a fixed hash seed and
without ASLR too: the allocator's timing-dependent state), hence min / max over the repeats. The
round trip is checked to be bit-exact. "above tiny" = peak minus the tiny model's lowest peak in
the same direction: what the conversion of the model itself costs, to be compared with the
model's and its largest tensor's size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
MEDIUM = [
    "name=qwen2-155m",
    "num_layers=8",
    "hidden_size=1024",
    "ffn_hidden_size=2816",
    "num_attention_heads=16",
    "num_query_groups=2",
    "vocab_size=32768",
]
DEEP = [*MEDIUM[1:], "name=qwen2-331m", "num_layers=24"]  # the same largest tensor, 3x the layers
MODELS = {"tiny-qwen2": [], "qwen2-155m": MEDIUM, "qwen2-331m": DEEP}  # name -> overrides of tiny-qwen2.yaml


def _run(argv: list[str]) -> dict:
    """Run ``argv`` in a child process; its wall time and peak RSS (ru_maxrss from wait4, MiB)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
    _, err = proc.stdout.read(), proc.stderr.read()  # both drained: a full pipe would block the child
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{argv} failed ({proc.returncode}):\n{err.decode()[-3000:]}")
    return {"wall_s": round(wall, 2), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1)}


def _repeat(argv: list[str], out: Path, repeats: int) -> dict:
    """``argv`` (which writes ``out``) ``repeats`` times; min/max peak RSS and median wall time.
    ``out`` is left from the last run."""
    runs = []
    for _ in range(repeats):
        shutil.rmtree(out, ignore_errors=True)
        runs.append(_run(argv))
    peaks = [r["peak_rss_mib"] for r in runs]
    return {
        "peak_rss_mib_min": min(peaks),
        "peak_rss_mib_max": max(peaks),
        "peak_rss_mib": peaks,
        "wall_s_median": statistics.median(r["wall_s"] for r in runs),
    }


def _model_stats(hf_dir: Path) -> dict:
    from tools.safetensors_stream import SafetensorsDirectory

    tensors = SafetensorsDirectory(hf_dir).tensors
    sizes = {name: t.end - t.begin for name, t in tensors.items()}
    largest = max(sizes, key=sizes.get)
    numel = sum(sizes.values()) // 4  # float32
    return {
        "parameters": numel,
        "bytes": sum(sizes.values()),
        "largest_tensor": largest,
        "largest_tensor_bytes": sizes[largest],
    }


def _bit_exact(a: Path, b: Path) -> bool:
    from tools.safetensors_stream import SafetensorsDirectory

    left, right = SafetensorsDirectory(a), SafetensorsDirectory(b)
    if sorted(left.tensors) != sorted(right.tensors):
        return False
    return all(left.read(n).equal(right.read(n)) and left.read(n).dtype == right.read(n).dtype for n in left.tensors)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "convert_memory_cpu.json")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each conversion (default 3)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    results = {}
    with tempfile.TemporaryDirectory(prefix="convert_memory_") as tmp:
        tmp = Path(tmp)
        for name, overrides in MODELS.items():
            hf, mg, back = tmp / f"{name}-hf", tmp / f"{name}-mg", tmp / f"{name}-back"
            _run([PYTHON, "tools/make_tiny_model.py", "tiny-qwen2", str(hf), *overrides])
            stats = _model_stats(hf)
            to_megatron = _repeat(
                [
                    PYTHON,
                    "tools/convert_hf_to_megatron.py",
                    str(hf),
                    str(mg),
                    "--tp",
                    "1",
                    "--pp",
                    "1",
                    "--no-progress",
                ],
                mg,
                args.repeats,
            )
            to_hf = _repeat(
                [PYTHON, "tools/convert_megatron_to_hf.py", str(mg), str(back), "--no-progress"], back, args.repeats
            )
            results[name] = {
                **stats,
                "hf_to_megatron": to_megatron,
                "megatron_to_hf": to_hf,
                "round_trip_bit_exact": _bit_exact(hf, back),
            }
            print(name, json.dumps(results[name]), flush=True)
    for direction in ("hf_to_megatron", "megatron_to_hf"):
        base = results["tiny-qwen2"][direction]["peak_rss_mib_min"]
        for name in MODELS:
            r = results[name][direction]
            r["above_tiny_mib"] = [round(r["peak_rss_mib_min"] - base, 1), round(r["peak_rss_mib_max"] - base, 1)]
    report = {
        "method": __doc__,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_after": os.getloadavg(),
        },
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
