"""Probe: rounding fp32 values to bf16 by round-to-odd first leaves MX quantization unchanged.

The rotated CUDA kernels quantize fp32 values (the butterfly's output) through the fp32 chunk code;
the plain kernels' bf16 pair code is shorter. Round-to-odd to bf16 (truncate, then set the last bit
when anything was dropped) keeps 8 significant bits, at least two more than any MX element format
below bf16 (E2M1 2, E5M2 3, E2M3 and E4M3 4 significant bits), so a round to nearest even after it gives
the direct rounding's result (double rounding through round-to-odd is exact), and it keeps every
comparison with a value of at most 7 significant bits (the amax rules' thresholds, the clip limit).
This checks it through the library: quantize(x) == quantize(rto_bf16(x)), codes and scale bytes, for
the amax rules, on values nudged around the grid's ties and on wide random data; the same check with
round-to-nearest-even to bf16 mismatches almost everywhere (the negative control). Not for quest,
QuTLASS absmax (which scales x by 3 first) or NVFP4 (which rounds x times a multiplier).

Run: python dev/probes/rto_bf16_double_rounding.py   (needs the mxq package; CPU)
"""
import torch

import mxq


def rto_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 by round-to-odd."""
    b = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    hi = b & 0xFFFF0000
    hi = torch.where((b & 0xFFFF) != 0, hi | 0x10000, hi)
    return (hi >> 16).to(torch.int32).to(torch.int16).view(torch.bfloat16)


def run(convert) -> tuple[int, int]:
    torch.manual_seed(0)
    bad = total = 0
    for fmt, rules in [("mxfp4", ["even", "floor", "rceil", "ceil"]), ("mxfp8_e4m3", ["even", "floor", "rceil"]),
                       ("mxfp6_e2m3", ["even", "rceil"]), ("mxfp8_e5m2", ["floor", "even"])]:
        for rule in rules:
            for trial in range(20):
                R, K = 256, 1024
                if trial % 2:
                    x = torch.randn(R, K) * torch.exp2(torch.randint(-30, 30, (R, 1)).float())
                else:  # E2M1 ties (n + 0.25 on a half-integer grid) nudged by a few fp32 ulps, per block 2^e
                    e = torch.randint(-20, 20, (R, K // 32, 1)).float()
                    mid = torch.round(torch.randn(R, K // 32, 32) * 8) / 2 + 0.25
                    nudge = torch.randint(-3, 4, mid.shape).float() * 2.0**-21
                    x = ((mid + nudge * mid.abs()) * torch.exp2(e)).reshape(R, K)
                x = x.float()
                qa, qb = mxq.quantize(x, fmt, rule=rule), mxq.quantize(convert(x), fmt, rule=rule)
                total += 1
                bad += not (torch.equal(qa.codes, qb.codes) and torch.equal(qa.scales, qb.scales))
    return bad, total


if __name__ == "__main__":
    bad, total = run(rto_bf16)
    print(f"round-to-odd bf16: {bad} of {total} cases differ")
    neg, _ = run(lambda x: x.to(torch.bfloat16))
    print(f"round-to-nearest-even bf16 (control): {neg} of {total} cases differ")
    raise SystemExit(1 if bad or not neg else 0)
