"""An independent plain-torch statement of mxq's numerics (docs/numerics.md), for the package tests:
element grids enumerated from each format's definition, nearest value by search, ties to the even
code, exact float64 arithmetic for the MX rules; the NVFP4 recipe step by step in float32. It shares
no code with the library; the C++ suites test the library far more thoroughly, this checks that the
Python layer passes every argument through."""
from __future__ import annotations

import functools

import torch

# element: (exponent bits, mantissa bits, bias, max finite)
ELEMENTS = {
    "e2m1": (2, 1, 1, 6.0), "e2m3": (2, 3, 1, 7.5), "e3m2": (3, 2, 3, 28.0),
    "e4m3": (4, 3, 7, 448.0), "e5m2": (5, 2, 15, 57344.0),
}
FORMAT_ELEMENT = {"mxfp4": "e2m1", "mxfp6_e2m3": "e2m3", "mxfp6_e3m2": "e3m2", "mxfp8_e4m3": "e4m3",
                  "mxfp8_e5m2": "e5m2", "mxint8": "int8"}
EMAX = {"e2m1": 2, "e2m3": 2, "e3m2": 4, "e4m3": 8, "e5m2": 15, "int8": 0}
MBITS = {"e2m1": 1, "e2m3": 3, "e3m2": 2, "e4m3": 3, "e5m2": 2, "int8": 6}


@functools.lru_cache(None)
def grid(elem: str) -> torch.Tensor:
    """The non-negative representable values of an element type, ascending (float64)."""
    if elem == "int8":
        return torch.arange(128, dtype=torch.float64) / 64.0
    eb, mb, bias, mx = ELEMENTS[elem]
    vals = set()
    for e in range(0, 1 << eb):
        for m in range(1 << mb):
            v = (m / (1 << mb)) * 2.0 ** (1 - bias) if e == 0 else (1 + m / (1 << mb)) * 2.0 ** (e - bias)
            if v <= mx:
                vals.add(v)
    return torch.tensor(sorted(vals), dtype=torch.float64)


def round_to_grid(v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """RNE of |v| onto grid g (saturating at its largest value); ties to the even index."""
    a = v.abs().clamp(max=float(g[-1]))
    hi = torch.searchsorted(g, a).clamp(max=len(g) - 1)
    lo = (hi - 1).clamp(min=0)
    dlo, dhi = a - g[lo], g[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    return torch.where(pick_hi, g[hi], g[lo])


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    m, e = torch.frexp(a)  # a = m * 2^e, m in [0.5, 1)
    return (e - 1).to(torch.float64)


def mx_exponent(amax: torch.Tensor, rule: str, elem: str) -> torch.Tensor:
    emax, mbits = EMAX[elem], MBITS[elem]
    maxv = 127 / 64 if elem == "int8" else ELEMENTS[elem][3]
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    fl = _floor_log2(safe)
    pow2 = torch.exp2(fl) == safe
    if rule == "floor":
        e = fl - emax
    elif rule == "ceil":
        e = fl + (~pow2).to(torch.float64) - emax
    elif rule == "even":
        q = 2.0 ** (fl - mbits)  # the quantum of amax's binade at mbits mantissa bits
        r = torch.round(safe / q) * q  # torch.round: half to even (exact in float64 here)
        e = _floor_log2(r) - emax
    elif rule == "even_fp4":
        # compressed-tensors' MX scale, as it is written there: add a quarter of the binade to amax and
        # keep the power of two (bump when the significand is >= 1.75), whatever the element format
        e = _floor_log2(safe + 2.0 ** (fl - 2)) - emax
    elif rule == "rceil":
        c = torch.ceil(torch.log2(safe / maxv))
        c = torch.where(maxv * torch.exp2(c - 1) >= safe, c - 1, c)  # make it exact
        e = torch.where(maxv * torch.exp2(c) >= safe, c, c + 1)
    else:
        raise ValueError(rule)
    return torch.where(amax > 0, e.clamp(-127, 127), torch.full_like(e, -127.0))


def mx_qdq(x: torch.Tensor, fmt: str, rule: str, group: int = 32) -> torch.Tensor:
    """QDQ of a 2-D float tensor with an MX format, in float64, rounded to x's dtype (saturating)."""
    elem = FORMAT_ELEMENT[fmt]
    rows, k = x.shape
    pad = (-k) % group
    xd = torch.nn.functional.pad(x.double(), (0, pad)).reshape(rows, -1, group)
    e = mx_exponent(xd.abs().amax(-1, keepdim=True), rule, elem)
    v = xd / torch.exp2(e)
    q = round_to_grid(v, grid(elem))
    if elem == "int8":
        y = torch.where(v < 0, -q, q) + 0.0  # no negative zero
    else:
        y = torch.copysign(q, v)
    y = (y * torch.exp2(e)).reshape(rows, -1)[:, :k]
    big = torch.finfo(x.dtype).max
    return y.clamp(-big, big).to(x.dtype)


def e4m3_rn_satfinite(v: torch.Tensor) -> torch.Tensor:
    return v.clamp(max=448.0).to(torch.float8_e4m3fn).to(torch.float32)


def nvfp4_qdq(x: torch.Tensor, tensor_scale=None) -> torch.Tensor:
    """The NVFP4 recipe (docs/numerics.md, "NVFP4"), every step a float32 operation, blocks of 16."""
    f = torch.float32
    xf = x.to(f)
    if tensor_scale is None:
        amax_t = xf.abs().max()
        S = torch.tensor(448.0 * 6.0, dtype=f) / amax_t if amax_t > 0 else torch.tensor(1.0, dtype=f)
        S = S.clamp(max=torch.finfo(f).max)
    else:
        S = torch.tensor(tensor_scale, dtype=f)
    rows, k = x.shape
    pad = (-k) % 16
    xb = torch.nn.functional.pad(xf, (0, pad)).reshape(rows, -1, 16)
    amax = xb.abs().amax(-1, keepdim=True)
    s = e4m3_rn_satfinite((amax * S) / torch.tensor(6.0, dtype=f))
    m = torch.where(s > 0, S / s, torch.zeros_like(s))
    q = round_to_grid((xb * m).double(), grid("e2m1")).to(f)
    q = torch.copysign(q, xb)
    y = ((q * s) / S).reshape(rows, -1)[:, :k]
    big = torch.finfo(x.dtype).max
    return y.clamp(-big, big).to(x.dtype)
