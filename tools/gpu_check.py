"""`make gpu-check`: what a developer runs first whenever a GPU machine is lent. One script, under
8 minutes on one GPU, ending in one summary line. Without a CUDA GPU it prints that it skipped and
exits 0 (CI never has one).

It runs, in order:
1. the tests marked `gpu` (pytest -m gpu; those needing more GPUs than the machine has skip);
2. a DP2 x TP2 MLP trained on four in-process ranks whose tensors live on the GPU, against the
   same job on the CPU: losses and updated weights must agree (the GPU runs fp32 with TF32 off);
3. the NCCL backend (torch.distributed) and the CuPy NCCL backend, each on a one-rank world of a
   real process, training the same model single-device: losses must match the CPU run;
4. a short step benchmark on the GPU in that NCCL process: hspmd's Trainer against a hand-written
   torch loop and DistributedDataParallel, the sides interleaved step by step; the median per-step
   ratio and its min-max spread.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

try:
    import torch
except ImportError:  # a python without torch (no venv yet) has no GPU to check either
    torch = None

STEPS, WARMUP = 30, 5
TOLERANCE = 1e-5


def gpu_tests() -> str:
    """Run the `gpu` tests; return pytest's closing counts."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    counts = re.findall(r"(\d+) (passed|failed|skipped|deselected|error)", done.stdout)
    summary = ", ".join(f"{n} {what}" for n, what in counts if what != "deselected") or "no result"
    if done.returncode not in (0, 5):
        print(done.stdout[-4000:], done.stderr[-2000:])
        raise SystemExit(f"gpu-check: FAILED: the gpu tests ({summary})")
    return summary


def train_mlp(backend, config, steps: int = 4) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train bench_step_vs_torch's MLP under its annotations on `backend`; the losses and this
    rank's weight pieces (on the CPU)."""
    from bench_step_vs_torch import batch, build_mlp

    from hspmd.runtime.execution.batches import MicroBatchLayout
    from hspmd.runtime.training.trainer import Trainer

    trainer = Trainer(build_mlp(config), 0, backend, MicroBatchLayout((1,), (config.batch,)), schedule="gpipe", symbols={})
    losses = [trainer.step(batch(config, i)) for i in range(steps)]
    whole = trainer.state_dict()  # collective; whole tensors on rank 0, None elsewhere
    return losses, {k: v.detach().cpu() for k, v in (whole or {}).items()}


def in_process_on_gpu() -> str:
    """DP2 x TP2 on four threads whose tensors live on the GPU equals the same job on the CPU."""
    from bench_step_vs_torch import CONFIGS

    from hspmd.backends.local import LocalWorld

    config = CONFIGS[1]
    runs = {device: LocalWorld(range(4), device=device).run(lambda b: train_mlp(b, config)) for device in ("cpu", "cuda")}
    worst = 0.0
    for rank in range(4):
        (cpu_loss, cpu_w), (gpu_loss, gpu_w) = runs["cpu"][rank], runs["cuda"][rank]
        worst = max([worst] + [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(cpu_loss, gpu_loss) if a is not None])
        worst = max([worst] + [float((cpu_w[k] - gpu_w[k]).abs().max()) for k in cpu_w])
    if worst > TOLERANCE:
        raise SystemExit(f"gpu-check: FAILED: DP2xTP2 on the GPU differs from the CPU by {worst:.2e}")
    return f"DP2xTP2 on cuda = cpu (max diff {worst:.1e})"


def single_device_mlp(config):
    """bench_step_vs_torch's model written for one device (every tensor whole on rank 0)."""
    from hspmd.ir import comm, parameter, placeholder, symbols
    from hspmd.ops import SGD, Graph, relu

    from bench_step_vs_torch import LR

    whole = "@[0]"
    g = Graph("mlp_one_device")
    (rows,) = symbols("B")
    x = placeholder(g, "x", (rows, config.hidden), annotation=whole)
    target = placeholder(g, "target", (rows, config.hidden), annotation=whole)
    for layer in range(config.layers):
        w1 = parameter(g, f"w1.{layer}", (config.hidden, config.ffn), annotation=whole)
        w2 = parameter(g, f"w2.{layer}", (config.ffn, config.hidden), annotation=whole)
        x = x + comm(relu(x @ w1) @ w2, whole, name=f"out.{layer}")
    d = x - target
    SGD(lr=LR).minimize((d * d).mean())
    return g


def one_rank_world(backend, config, kind: str) -> dict:
    """On a one-rank NCCL (or CuPy) world: train the single-device model, then time hspmd's step
    against plain torch and DDP, interleaved."""
    import torch.distributed as dist

    from bench_step_vs_torch import LR, batch

    from hspmd.ir import initial_value
    from hspmd.runtime.execution.batches import MicroBatchLayout
    from hspmd.runtime.training.trainer import Trainer

    if kind == "cupy":
        from hspmd.backends.cupy_nccl import CupyNcclBackend

        backend = CupyNcclBackend.from_env(timeout=60)
    torch.backends.cuda.matmul.allow_tf32 = False
    graph = single_device_mlp(config)
    trainer = Trainer(graph, 0, backend, MicroBatchLayout((1,), (config.batch,)), schedule="gpipe", symbols={})
    losses = [trainer.step(batch(config, i)) for i in range(4)]
    if kind == "cupy":
        backend.close()
        return {"losses": losses}
    device = backend.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    initial = {n.name: initial_value(n).to(device) for n in graph.parameters}

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.ParameterList(torch.nn.Parameter(initial[f"w{i}.{layer}"].clone())
                                            for layer in range(config.layers) for i in (1, 2))

        def forward(self, x):
            for w1, w2 in zip(self.w[0::2], self.w[1::2]):
                x = x + torch.relu(x @ w1) @ w2
            return x

    plain, ddp_model = Plain(), Plain()
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model, process_group=dist.group.WORLD, gradient_as_bucket_view=True)

    def torch_step(model, params):
        def run(b):
            x, target = b["x"].to(device), b["target"].to(device)
            loss = ((model(x) - target) ** 2).mean()
            loss.backward()
            with torch.no_grad():
                for w in params:
                    w -= LR * w.grad
                    w.grad = None
            return float(loss.detach())
        return run

    timed = Trainer(graph, 0, backend, MicroBatchLayout((1,), (config.batch,)), schedule="gpipe", symbols={})
    sides = {"hspmd": timed.step, "torch": torch_step(plain, list(plain.parameters())),
             "DDP": torch_step(ddp, list(ddp_model.parameters()))}
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for i in range(WARMUP + STEPS):
        b = batch(config, 100 + i)
        order = names[i % len(names):] + names[: i % len(names)]
        for name in order:
            sync()
            start = time.perf_counter()
            sides[name](b)
            sync()
            if i >= WARMUP:
                seconds[name].append(time.perf_counter() - start)
    return {"losses": losses, "seconds": seconds}


def cpu_losses(config) -> list[float]:
    from hspmd.backends.local import LocalWorld

    return LocalWorld([0]).run(lambda b: train_mlp_single(b, config))[0]


def train_mlp_single(backend, config) -> list[float]:
    from bench_step_vs_torch import batch

    from hspmd.runtime.execution.batches import MicroBatchLayout
    from hspmd.runtime.training.trainer import Trainer

    trainer = Trainer(single_device_mlp(config), 0, backend, MicroBatchLayout((1,), (config.batch,)), schedule="gpipe",
                      symbols={})
    return [trainer.step(batch(config, i)) for i in range(4)]


def ratio_text(seconds: dict[str, list[float]], side: str, baseline: str) -> str:
    ratios = [a / b for a, b in zip(seconds[side], seconds[baseline])]
    return f"{statistics.median(ratios):.2f}x {baseline} ({min(ratios):.2f}-{max(ratios):.2f})"


def main() -> int:
    if torch is None or not torch.cuda.is_available():
        print("gpu-check: skipped (no CUDA GPU on this machine)")
        return 0
    from bench_step_vs_torch import CONFIGS

    from hspmd.runtime.processes.multiprocess import run_multiprocess

    began = time.perf_counter()
    name = torch.cuda.get_device_name(0)
    print(f"gpu-check on {name}, torch {torch.__version__}", flush=True)
    tests = gpu_tests()
    print(f"  gpu tests: {tests}", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    in_process = in_process_on_gpu()
    print(f"  {in_process}", flush=True)
    parts = [f"gpu tests {tests}", in_process]
    for config in CONFIGS:
        reference = cpu_losses(config)
        nccl = run_multiprocess(one_rank_world, 1, config, "nccl", backend="nccl", timeout=240)[0]
        worst = max(abs(a - b) / abs(b) for a, b in zip(nccl["losses"], reference))
        if worst > TOLERANCE:
            raise SystemExit(f"gpu-check: FAILED: NCCL losses {nccl['losses']} differ from the CPU's {reference}")
        step = ", ".join(ratio_text(nccl["seconds"], "hspmd", base) for base in ("torch", "DDP"))
        medians = ", ".join(f"{k} {statistics.median(v) * 1e3:.2f} ms" for k, v in nccl["seconds"].items())
        print(f"  {config.name}: NCCL losses = CPU (rel {worst:.1e}); step hspmd {step}; {medians}", flush=True)
        parts.append(f"{config.name.split()[0]} step hspmd {step}")
    try:
        import cupy  # noqa: F401
    except ImportError:
        parts.append("CuPy absent")
    else:
        cupy_run = run_multiprocess(one_rank_world, 1, CONFIGS[0], "cupy", timeout=240)[0]
        worst = max(abs(a - b) / abs(b) for a, b in zip(cupy_run["losses"], cpu_losses(CONFIGS[0])))
        if worst > TOLERANCE:
            raise SystemExit(f"gpu-check: FAILED: CuPy NCCL losses differ from the CPU's by {worst:.1e}")
        parts.append(f"CuPy NCCL = CPU (rel {worst:.1e})")
    print(f"gpu-check: PASSED on {name} in {time.perf_counter() - began:.0f} s: " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
