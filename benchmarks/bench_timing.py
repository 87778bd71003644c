"""Timing for the kernel benchmark (``bench_kernels.py``): forward + backward in one timing window (CUDA events,
no synchronisation inside), the three bare GEMMs of an lm_head (the floor), and the two ceilings of the prediction
measured on the device (a ``torch.mm`` rate and a device-copy bandwidth). Seconds and FLOP/s or bytes/s throughout.
"""

from __future__ import annotations

import statistics
import time

import roofline
import torch


class Clock:
    """Timestamps on ``device``: CUDA events (recorded on the stream, no synchronisation between them) or
    ``time.perf_counter`` on the CPU. :meth:`stamp` returns a mark, :meth:`seconds` the time between two marks
    (after :meth:`wait`)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def stamp(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wait(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


def spread(xs: list[float]) -> dict:
    """``{"min", "median", "max", "n"}`` of ``xs`` (seconds)."""
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def time_fwd_bwd(fn, leaves, repeats: int, warmup: int, device: torch.device) -> dict:
    """Forward + backward of ``fn`` in one timing window per repeat (marks before, between and after; no
    synchronisation inside the window): ``{"total", "fwd", "bwd"}`` spreads and the last loss."""
    clock, tot, fwd, bwd, loss = Clock(device), [], [], [], None
    for i in range(warmup + repeats):
        for x in leaves:
            x.grad = None
        clock.wait()
        t0 = clock.stamp()
        out = fn()
        t1 = clock.stamp()
        out.backward()
        t2 = clock.stamp()
        clock.wait()
        loss = float(out.detach())
        del out
        if i >= warmup:
            tot.append(clock.seconds(t0, t2))
            fwd.append(clock.seconds(t0, t1))
            bwd.append(clock.seconds(t1, t2))
    for x in leaves:
        x.grad = None
    return {"total": spread(tot), "fwd": spread(fwd), "bwd": spread(bwd), "loss": loss}


def time_gemms(N: int, D: int, V: int, dtype: torch.dtype, device: torch.device, repeats: int, warmup: int) -> dict:
    """The floor: the three bare GEMMs of the lm_head (logits = h·Wᵀ, dL/dh = G·W, dL/dW = Gᵀ·h) on (N, D) and
    (V, D) operands, in one timing window per repeat (spread) and each alone (medians, seconds); ``dense_s``
    adds a second logits GEMM (a dense teacher's, same head)."""
    clock = Clock(device)
    t = {"h": torch.randn(N, D, device=device).to(dtype), "w": torch.randn(V, D, device=device).to(dtype),
         "logits": torch.empty(N, V, device=device, dtype=dtype), "dh": torch.empty(N, D, device=device, dtype=dtype),
         "dW": torch.empty(V, D, device=device, dtype=dtype)}
    steps = {"logits": lambda: torch.mm(t["h"], t["w"].t(), out=t["logits"]),
             "dh": lambda: torch.mm(t["logits"], t["w"], out=t["dh"]),
             "dW": lambda: torch.mm(t["logits"].t(), t["h"], out=t["dW"])}
    each = {k: [] for k in steps}
    total = []
    for i in range(warmup + repeats):
        clock.wait()
        marks = [clock.stamp()]
        for step in steps.values():
            step()
            marks.append(clock.stamp())
        clock.wait()
        if i >= warmup:
            total.append(clock.seconds(marks[0], marks[-1]))
            for k, a, b in zip(steps, marks, marks[1:], strict=False):
                each[k].append(clock.seconds(a, b))
    t.clear()  # the (N, V) logits go before the implementations run
    out = {"total": spread(total), **{f"{k}_s": statistics.median(v) for k, v in each.items()}}
    out["three_s"] = out["total"]["median"]
    out["dense_s"] = out["three_s"] + out["logits_s"]
    return out


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int | None = None, repeats: int = 10) -> float:
    """Measured ``torch.mm`` FLOP/s at an (n × n) @ (n × n) product in ``dtype`` (GPU: 8192, CPU: 512)."""
    n = n or (8192 if device.type == "cuda" else 512)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2.0 * n**3 / _median_time(lambda: torch.mm(a, b), device, repeats)


def copy_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 10) -> float:
    """Measured device-to-device copy bandwidth, bytes/s counting the read and the write (GPU: 1 GiB, CPU: 64 MiB)."""
    nbytes = nbytes or (2**30 if device.type == "cuda" else 2**26)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2.0 * nbytes / _median_time(lambda: dst.copy_(src), device, repeats)


def _median_time(step, device: torch.device, repeats: int, warmup: int = 3) -> float:
    clock, times = Clock(device), []
    for i in range(warmup + repeats):
        clock.wait()
        a = clock.stamp()
        step()
        b = clock.stamp()
        clock.wait()
        if i >= warmup:
            times.append(clock.seconds(a, b))
    return statistics.median(times)


def measure_ceilings(device: torch.device, dtype: torch.dtype) -> roofline.Rates:
    """The two ceilings of the prediction, measured now on ``device``: the ``dtype`` matmul rate (and fp32's) and
    the copy bandwidth."""
    rate = matmul_rate(device, dtype)
    fp32 = rate if dtype == torch.float32 else matmul_rate(device, torch.float32, n=4096 if device.type == "cuda"
                                                            else None)
    bw = copy_bandwidth(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "this CPU"
    return roofline.Rates(matmul_flops=rate, copy_bytes=bw, matmul_fp32_flops=fp32,
                          source=f"measured in this call on {name}: {str(dtype).removeprefix('torch.')} torch.mm "
                                 f"{_flops(rate)}, fp32 {_flops(fp32)}, copy {bw / 1e9:.0f} GB/s")


def _flops(rate: float) -> str:
    return f"{rate / 1e12:.1f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.1f} GFLOP/s"
