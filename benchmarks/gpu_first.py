"""The first GPU hour, unattended: every check the 13B story waits on, in one command of at most 9 minutes.

    OUT=/some/folder python3 benchmarks/gpu_first.py          # a lent H100 or H200: its own python3 with CUDA torch
    OUT=/some/folder python3 benchmarks/gpu_first.py --cpu    # the same steps at toy sizes on the CPU (make test-full)

``make gpu-first`` runs it (``GPU_DRY=1``: ``--cpu``). A lent machine is bare: no package registry, no venv, no
hydra-core. Each step runs in its own process under its own timeout with hydra and omegaconf made unimportable (a
GPU test or benchmark that imports them fails here, not on the lent machine); a step that fails or runs out of time
is recorded with the tail of its output and the next one runs. Written under ``$OUT`` (default
``outputs/gpu_first``): ``steps.json`` (each step's command, seconds, exit status), each step's own JSON and output,
and ``summary.md``, one page with each planner figure beside the measured one. In order:

1. ``environment``: torch, CUDA and cuSPARSELt versions, the device, its SM clock and power (``nvidia-smi``);
2. ``gemms``: the 13B block's GEMMs (forward, input gradient, weight gradient, micro 1 and 2) and an 8192^3 GEMM,
   measured TFLOP/s beside the planner's roofline (``planner/profile.gemm_seconds``);
3. ``semi_sparse``: the 2:4 kernels on the 13B block's matrices (``gpu_semi_sparse.py``: the backend the device
   takes, or its refusal by name);
4. ``slice_micro1`` and ``slice_micro2``: a 4-block slice of the 13B model on one GPU, Flush, ZB-H1 and 2BW, 8
   samples per step (``gpu_stage.py``: each step beside the planner's roofline, each peak beside its memory model);
5. ``pytest_gpu``: the GPU tests (``pytest -m gpu tests/gpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()
# run before a step's own code: hydra and omegaconf unimportable, as on a bare GPU machine
NO_HYDRA = "import sys; sys.modules['hydra'] = None; sys.modules['omegaconf'] = None; import runpy; "


@dataclass(frozen=True)
class Step:
    name: str
    seconds: int  # its timeout
    gpu: tuple[str, ...]  # the command's arguments after the Python, on a GPU ({out}: the output folder)
    cpu: tuple[str, ...]  # the same at toy sizes on the CPU


SLICE = ("--model", "gpt13b", "--layers", "4", "--steps", "6", "--warmup", "2", "--runs", "flush,zb_h1,2bw")
TOY_SLICE = ("--device", "cpu", "--model", "small", "--layers", "2", "--seq", "64", "--micro", "1", "--m", "2")
TOY_SLICE += ("--steps", "2", "--warmup", "1", "--runs", "flush,zb_h1")
STEPS = (
    Step("environment", 60, (str(HERE), "--step", "environment"), (str(HERE), "--step", "environment")),
    Step("gemms", 90, (str(HERE), "--step", "gemms"), (str(HERE), "--step", "gemms", "--cpu")),
    Step(
        "semi_sparse",
        90,
        ("benchmarks/gpu_semi_sparse.py", "--iters", "10", "--json", "{out}/semi_sparse.json"),
        (str(HERE), "--step", "semi_sparse_refusal"),
    ),
    Step(
        "slice_micro1",
        150,
        ("benchmarks/gpu_stage.py", *SLICE, "--micro", "1", "--m", "8", "--json", "{out}/slice_micro1.json"),
        ("benchmarks/gpu_stage.py", *TOY_SLICE, "--json", "{out}/slice_micro1.json"),
    ),
    Step(
        "slice_micro2",
        150,
        ("benchmarks/gpu_stage.py", *SLICE, "--micro", "2", "--m", "4", "--json", "{out}/slice_micro2.json"),
        ("benchmarks/gpu_stage.py", *TOY_SLICE, "--json", "{out}/slice_micro2.json"),
    ),
    Step(
        "pytest_gpu",
        150,
        ("-m", "pytest", "-q", "-m", "gpu", "tests/gpu", "-p", "no:cacheprovider"),
        ("-m", "pytest", "-q", "-m", "gpu", "tests/gpu", "-p", "no:cacheprovider", "--co"),
    ),
)


def run_step(step: Step, out: Path, cpu: bool) -> dict:
    """One step in its own process under its timeout, hydra unimportable; its output kept in ``out/NAME.log``."""
    arguments = [a.format(out=out) for a in (step.cpu if cpu else step.gpu)]
    if arguments[0] == "-m":  # a module (pytest): run as ``python -m``, hydra blocked first
        code = (
            NO_HYDRA
            + f"sys.argv = {[arguments[1], *arguments[2:]]!r}; runpy.run_module({arguments[1]!r}, run_name='__main__')"
        )
    else:
        code = NO_HYDRA + f"sys.argv = {arguments!r}; runpy.run_path({arguments[0]!r}, run_name='__main__')"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OUT=str(out))
    if arguments[:2] == ["-m", "pytest"]:  # no plugin loaded from an installed package's entry point (hydra's)
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=step.seconds
        )
        status, output = ("ok" if done.returncode == 0 else f"failed ({done.returncode})"), done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        status = f"timed out after {step.seconds} s"
        output = (expired.stdout or b"").decode(errors="replace") + (expired.stderr or b"").decode(errors="replace")
    (out / f"{step.name}.log").write_text(output)
    return {
        "step": step.name,
        "command": f"python3 {' '.join(arguments)}",
        "seconds": round(time.perf_counter() - start, 1),
        "status": status,
        "tail": output[-1500:] if status != "ok" else "",
    }


def environment(out: Path) -> None:
    """The versions, the device and its clocks: what every later figure depends on."""
    import torch

    facts: dict = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        facts["device"] = torch.cuda.get_device_name()
        facts["capability"] = list(torch.cuda.get_device_capability())
        facts["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        cusparselt = getattr(torch.backends, "cusparselt", None)
        facts["cusparselt"] = cusparselt.version() if cusparselt is not None and cusparselt.is_available() else None
        query = "clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu"
        try:
            smi = subprocess.run(
                ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True, text=True
            )
            facts["nvidia_smi"] = dict(zip(query.split(","), smi.stdout.strip().split(", ")))
        except OSError as error:
            facts["nvidia_smi"] = f"not run: {error}"
    else:
        facts["device"] = "cpu"
    (out / "environment.json").write_text(json.dumps(facts, indent=1))
    print(json.dumps(facts))


def gemm_shapes(hidden: int, tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, rows, cols, reduction) of a GPT block's GEMMs over ``tokens`` rows: each linear map's forward, input
    gradient and weight gradient (``planner/profile.linear_seconds``' three)."""
    from lightning_pd2bw.planner.profile import block_linears

    shapes = []
    for fan_in, fan_out in block_linears(hidden):
        shapes += [
            (f"{fan_in}x{fan_out} forward", tokens, fan_out, fan_in),
            (f"{fan_in}x{fan_out} input gradient", tokens, fan_in, fan_out),
            (f"{fan_in}x{fan_out} weight gradient", fan_in, fan_out, tokens),
        ]
    return shapes


def gemms(out: Path, cpu: bool) -> None:
    """Each GEMM's median time (bf16 on the GPU, float32 on the CPU) and its TFLOP/s beside the planner's roofline
    for the device preset named like this GPU (none on the CPU)."""
    import statistics

    import torch

    from lightning_pd2bw.planner.hardware import DEVICES
    from lightning_pd2bw.planner.profile import gemm_seconds

    device = "cpu" if cpu else "cuda"
    dtype = torch.float32 if cpu else torch.bfloat16
    hidden, seq, large = (64, 32, 256) if cpu else (5120, 2048, 8192)
    name = "cpu" if cpu else torch.cuda.get_device_name()
    preset = None if cpu else next((k for k in DEVICES if k.split("_")[0].upper() in name), None)
    cases = [
        (f"micro {micro}: {label}", *shape) for micro in (1, 2) for label, *shape in gemm_shapes(hidden, seq * micro)
    ]
    cases.append((f"{large}^3", large, large, large))
    records = []
    for label, rows, cols, reduction in cases:
        a = torch.randn(rows, reduction, device=device, dtype=dtype)
        b = torch.randn(reduction, cols, device=device, dtype=dtype)
        times = []
        for i in range(13):
            if not cpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            a @ b
            if not cpu:
                torch.cuda.synchronize()
            if i >= 3:
                times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        flops = 2 * rows * cols * reduction
        planned = gemm_seconds(rows, cols, reduction, 2, DEVICES[preset]) if preset else None
        records.append(
            {
                "gemm": label,
                "shape": [rows, cols, reduction],
                "seconds": seconds,
                "tflops": flops / seconds / 1e12,
                "planner_tflops": flops / planned / 1e12 if planned else None,
            }
        )
        print(f"{label:40s} {records[-1]['tflops']:8.2f} TFLOP/s  planner {records[-1]['planner_tflops'] or '-'}")
    (out / "gemms.json").write_text(json.dumps({"device": name, "preset": preset, "records": records}, indent=1))


def semi_sparse_refusal() -> None:
    """The CPU mode of the 2:4 step: the kernels' backend choice refuses the CPU by name (the GPU runs the kernels)."""
    import torch
    from torch import nn

    from lightning_pd2bw.sparsity.semi_sparse import refusal

    why = refusal("mlp.fc", nn.Linear(128, 512), torch.device("cpu"), torch.bfloat16)
    if why is None or "cpu" not in why:
        raise SystemExit(f"the 2:4 kernels were not refused by name on the CPU: {why!r}")
    print(f"refused, as it should be on a CPU: {why}")


def summary(out: Path, results: list[dict], cpu: bool) -> str:
    """One page: each step's status, then each planner figure beside the measured one."""
    lines = [f"# gpu_first ({'CPU mode' if cpu else 'GPU'}), {time.strftime('%Y-%m-%d %H:%M')}", ""]
    facts = json.loads((out / "environment.json").read_text()) if (out / "environment.json").exists() else {}
    lines += [f"environment: {json.dumps(facts)}", "", "| step | status | seconds |", "|---|---|---|"]
    lines += [f"| {r['step']} | {r['status']} | {r['seconds']} |" for r in results]
    if (out / "gemms.json").exists():
        found = json.loads((out / "gemms.json").read_text())
        lines += ["", f"GEMMs on {found['device']} (planner preset {found['preset']}):", ""]
        lines += ["| GEMM | measured TFLOP/s | planner TFLOP/s |", "|---|---|---|"]
        for r in found["records"]:
            planned = f"{r['planner_tflops']:.1f}" if r["planner_tflops"] else "-"
            lines.append(f"| {r['gemm']} | {r['tflops']:.2f} | {planned} |")
    for name in ("slice_micro1", "slice_micro2"):
        if (out / f"{name}.json").exists():
            lines += ["", f"{name} (one GPU, 4 blocks of 13B; planner's bytes from its memory model):", ""]
            lines += ["| run | step s | peak GiB | planner GiB |", "|---|---|---|---|"]
            for r in json.loads((out / f"{name}.json").read_text()):
                planned = f"{r['predicted_bytes'] / 2**30:.2f}" if "predicted_bytes" in r else "-"
                lines.append(
                    f"| {r['kind']} | {r['step_s']:.4f} | {r['max_memory_allocated'] / 2**30:.2f} | {planned} |"
                )
    for r in results:
        if r["tail"]:
            lines += ["", f"{r['step']} ({r['status']}), the end of its output:", "", "```", r["tail"].strip(), "```"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="every step at toy sizes on the CPU")
    parser.add_argument("--step", help=argparse.SUPPRESS)  # one step's own code, run in its process
    parser.add_argument("--only", help="comma-separated step names (default: all)")
    args = parser.parse_args()
    out = Path(os.environ.get("OUT") or ROOT / "outputs" / "gpu_first")
    out.mkdir(parents=True, exist_ok=True)
    if args.step == "environment":
        return environment(out)
    if args.step == "gemms":
        return gemms(out, args.cpu)
    if args.step == "semi_sparse_refusal":
        return semi_sparse_refusal()
    chosen = [s for s in STEPS if not args.only or s.name in args.only.split(",")]
    results = []
    for step in chosen:
        results.append(run_step(step, out, args.cpu))
        print(f"[gpu_first] {step.name}: {results[-1]['status']} ({results[-1]['seconds']} s)", flush=True)
        (out / "steps.json").write_text(json.dumps(results, indent=1))
    (out / "summary.md").write_text(summary(out, results, args.cpu))
    print((out / "summary.md").read_text())
    print(f"[gpu_first] written under {out}")


if __name__ == "__main__":
    main()
