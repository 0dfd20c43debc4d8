"""The Triton kernels of looptool's fused ops on CUDA against the device's measured limits.

Elementwise kernels (gated_residual, the adaptive-delta update, i.e. the kernel without its
gate GEMM) are timed against the device's measured copy bandwidth (``torch`` device-to-device
copy of the same bytes; target: ≥ 80%); ``modulate`` against the same bytes it must move;
``moe`` (bf16, batch·seq tokens ≥ 4096, Qwen3-30B-A3B-like shapes: d 2048, I 768, 128
experts, top-8) in achieved TFLOP/s against a dense bf16 ``torch.mm`` of the same total FLOPs
measured in the same run (target: ≥ 50%), and against the unfused reference op.

Each contender: CUDA-event timing, ``--rounds`` interleaved rounds of ``--iters`` launches,
min/median/max ms. Run on a GPU: python tests/bench/bench_kernels.py [--out FILE]. Prints
one JSON line. (On a CPU it refuses: the interpreter measures nothing.)
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from looptool.ops import fused


def _time(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _stats(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=8192, help="batch·seq rows of the hidden state")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA GPU.")
    from looptool.ops import kernels

    dev, bf16 = "cuda", torch.bfloat16
    T, d = args.tokens, args.hidden
    x, f, s, r, z = (torch.randn(T, d, device=dev, dtype=bf16) for _ in range(5))
    gate, gamma, ex = (torch.randn(d, device=dev, dtype=bf16) for _ in range(3))
    copy_src = torch.empty(4 * T * d, device=dev, dtype=bf16)  # the adaptive update's 4 tensors' bytes
    copy_dst = torch.empty_like(copy_src)
    # moe: Qwen3-30B-A3B-like
    E, I, k, dm, Tm = 128, 768, 8, 2048, max(4096, args.tokens // 2)  # noqa: E741 (I: the expert intermediate size, as in the MoE papers)
    xm = torch.randn(Tm, dm, device=dev, dtype=bf16)
    gu = torch.randn(E, 2 * I, dm, device=dev, dtype=bf16) * dm**-0.5
    dn = torch.randn(E, dm, I, device=dev, dtype=bf16) * I**-0.5
    w, ids = torch.softmax(torch.randn(Tm, E, device=dev), -1).topk(k, dim=-1)
    w = w.to(bf16)
    moe_flops = 2 * Tm * k * (2 * I * dm + I * dm)
    side = int(round((moe_flops / 2) ** (1 / 3) / 64)) * 64
    a_mm, b_mm = (torch.randn(side, side, device=dev, dtype=bf16) for _ in range(2))
    mm_flops = 2 * side**3
    rank = 64
    sc, sh = gate + 1, gamma
    down, up = (
        torch.randn(rank, d, device=dev, dtype=bf16) * d**-0.5,
        torch.randn(d, rank, device=dev, dtype=bf16) * rank**-0.5,
    )

    def elementwise_update():
        out = torch.empty_like(s)
        n = s.numel()
        kernels.adaptive_delta_kernel[(n + kernels.ELEMENTWISE_BLOCK - 1) // kernels.ELEMENTWISE_BLOCK,](
            s, r, z, gamma, ex, n, d, d, out, HAS_EXIT=True, BLOCK=kernels.ELEMENTWISE_BLOCK
        )

    contenders = {
        "copy_4x": lambda: copy_dst.copy_(copy_src),
        "gated_residual": lambda: kernels.gated_residual(x, gate, f),
        "gated_residual_reference": lambda: fused.gated_residual_reference(x, gate, f),
        "adaptive_update": elementwise_update,
        "modulate": lambda: kernels.modulate(x, sc, sh, down, up),
        "modulate_reference": lambda: fused.modulate_reference(x, sc, sh, down, up),
        "moe": lambda: kernels.moe(xm, w, ids, gu, dn),
        "moe_reference": lambda: fused.moe_reference(xm, w, ids, gu, dn),
        "dense_mm_same_flops": lambda: a_mm @ b_mm,
    }
    times = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, fn in contenders.items():
            times[name].append(_time(fn, args.iters if "reference" not in name else max(2, args.iters // 5)))
    med = {name: statistics.median(v) for name, v in times.items()}
    copy_bw = 2 * copy_src.numel() * 2 / (med["copy_4x"] * 1e-3)  # read + write bytes/s
    bytes_gr = 3 * T * d * 2  # x, f read; out written (gate negligible)
    bytes_ad = 4 * T * d * 2  # s, r, z read; out written
    bytes_mod = 3 * T * d * 2  # x read in each of the two passes, out written once
    result = {
        "device": torch.cuda.get_device_name(),
        "tokens": T,
        "hidden": d,
        "ms": {name: _stats(v) for name, v in times.items()},
        "copy_GBps": copy_bw / 1e9,
        "gated_residual_GBps": bytes_gr / (med["gated_residual"] * 1e-3) / 1e9,
        "adaptive_update_GBps": bytes_ad / (med["adaptive_update"] * 1e-3) / 1e9,
        "modulate_GBps": bytes_mod / (med["modulate"] * 1e-3) / 1e9,
        "moe_TFLOPs": moe_flops / (med["moe"] * 1e-3) / 1e12,
        "dense_mm_TFLOPs": mm_flops / (med["dense_mm_same_flops"] * 1e-3) / 1e12,
        "moe_tokens": Tm,
        "moe_shape": {"experts": E, "inter": I, "top_k": k, "hidden": dm},
    }
    result["gated_residual_of_copy"] = result["gated_residual_GBps"] / result["copy_GBps"]
    result["adaptive_update_of_copy"] = result["adaptive_update_GBps"] / result["copy_GBps"]
    result["moe_of_dense_mm"] = result["moe_TFLOPs"] / result["dense_mm_TFLOPs"]
    result["moe_vs_reference_speedup"] = med["moe_reference"] / med["moe"]
    line = json.dumps(result)
    print(line)
    if args.out:
        open(args.out, "w").write(line + "\n")


if __name__ == "__main__":
    main()
