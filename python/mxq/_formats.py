"""Format and scale-rule names (as the C++ library's to_string / parse_* spell them), friendly aliases,
and the shape facts the fake (meta) implementations need. tests/python/test_formats.py checks these
facts against the kernels (shapes, saturation)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["FORMATS", "RULES", "FormatInfo", "format_info", "rules_for", "canonical_format", "canonical_rule",
           "default_rule"]


@dataclass(frozen=True)
class FormatInfo:
    """Facts of one microscaling format (docs/numerics.md, "Element formats")."""

    name: str
    element: str  # e2m1, e2m3, e3m2, e4m3, e5m2, int8
    bits: int  # element bits: 4, 6 or 8 (FP4 packs two codes per byte, the others one per byte)
    default_group: int  # 32 for MX, 16 for NVFP4
    max_elem: float  # largest finite element value
    e8m0_scale: bool  # True: E8M0 block scale (MX); False: E4M3 block scale + fp32 tensor scale (NVFP4) or
    # UE5M3 block scale (nvfp4_e5m3)


_INFO = {
    "mxfp4": FormatInfo("mxfp4", "e2m1", 4, 32, 6.0, True),
    "mxfp6_e2m3": FormatInfo("mxfp6_e2m3", "e2m3", 6, 32, 7.5, True),
    "mxfp6_e3m2": FormatInfo("mxfp6_e3m2", "e3m2", 6, 32, 28.0, True),
    "mxfp8_e4m3": FormatInfo("mxfp8_e4m3", "e4m3", 8, 32, 448.0, True),
    "mxfp8_e5m2": FormatInfo("mxfp8_e5m2", "e5m2", 8, 32, 57344.0, True),
    "mxint8": FormatInfo("mxint8", "int8", 8, 32, 127.0 / 64.0, True),
    "nvfp4": FormatInfo("nvfp4", "e2m1", 4, 16, 6.0, False),
    "nvfp4_e5m3": FormatInfo("nvfp4_e5m3", "e2m1", 4, 16, 6.0, False),
}
FORMATS: tuple[str, ...] = tuple(_INFO)
RULES: tuple[str, ...] = ("floor", "ceil", "even", "rceil", "even_fp4", "quest", "qutlass_absmax", "nvfp4",
                          "nvfp4_e5m3")
_RULE_SET = frozenset(RULES)

# The rules each format accepts, and why a rule is defined for its formats only: the library's catalogue
# (mxq::rules_for, mxq::rule_refusal in src/core/formats.cpp; docs/api.md, "Formats x scale rules"), for
# the fakes to refuse what the kernels refuse. tests/python/test_formats.py checks both against the kernels.
_MX_RULES = ("floor", "ceil", "even", "rceil")
_RULES_OF = {
    "mxfp4": _MX_RULES + ("even_fp4", "quest", "qutlass_absmax"),
    "mxfp6_e2m3": _MX_RULES,
    "mxfp6_e3m2": _MX_RULES,
    "mxfp8_e4m3": _MX_RULES + ("even_fp4",),
    "mxfp8_e5m2": _MX_RULES,
    "mxint8": _MX_RULES,
    "nvfp4": ("nvfp4", "quest"),
    "nvfp4_e5m3": ("nvfp4_e5m3",),
}
_RULE_SCOPE = {
    **{r: "an E8M0 block scale from the element's own range" for r in _MX_RULES},
    "even_fp4": "compressed-tensors' rule for its checkpoints",
    "quest": "its constant 2.92247856 / 6 fits the E2M1 grid",
    "qutlass_absmax": "QuTLASS's abs_max, whose elements are E2M1(3 x / 2^e)",
    "nvfp4": "NVFP4's recipe: an E4M3 block scale under an fp32 tensor scale",
    "nvfp4_e5m3": "the vllm-qdq-plugin's UE5M3 block scale RNE(amax / 6)",
}

_FORMAT_ALIASES = {"mxfp8": "mxfp8_e4m3", "mxfp6e2m3": "mxfp6_e2m3", "mxfp6e3m2": "mxfp6_e3m2",
                   "mxfp8e4m3": "mxfp8_e4m3", "mxfp8e5m2": "mxfp8_e5m2"}
_RULE_ALIASES = {"abs_max": "qutlass_absmax", "absmax": "qutlass_absmax", "qutlass_abs_max": "qutlass_absmax"}


def _norm(s: str) -> str:
    return s.strip().lower().replace("-", "_")


def canonical_format(name: str) -> str:
    """The library's name of a format: exact names (mxfp4, mxfp6_e2m3, mxfp6_e3m2, mxfp8_e4m3,
    mxfp8_e5m2, mxint8, nvfp4, nvfp4_e5m3), case-insensitive, '-' for '_', and the alias mxfp8 -> mxfp8_e4m3."""
    if name in _INFO:  # the fast path: already the library's name
        return name
    if not isinstance(name, str):
        raise TypeError(f"mxq: argument 'format': expected a str, got {type(name).__name__}")
    n = _norm(name)
    if n in _INFO:
        return n
    if n in _FORMAT_ALIASES:
        return _FORMAT_ALIASES[n]
    hint = " ('mxfp6' is ambiguous: mxfp6_e2m3 or mxfp6_e3m2)" if n == "mxfp6" else ""
    raise ValueError(f"mxq: unknown format '{name}'{hint}; expected one of: {', '.join(FORMATS)} (or mxfp8)")


def default_rule(fmt: str) -> str:
    """The rule used when none is given: nvfp4 for NVFP4, nvfp4_e5m3 for nvfp4_e5m3 (its only rule), the
    OCP MX v1.0 floor rule otherwise."""
    return fmt if fmt in ("nvfp4", "nvfp4_e5m3") else "floor"


def canonical_rule(name: Optional[str], fmt: str) -> str:
    """The library's name of a scale rule (floor, ceil, even, rceil, even_fp4, quest, qutlass_absmax, nvfp4, nvfp4_e5m3;
    abs_max is accepted for qutlass_absmax); None gives the format's default rule."""
    if name is None:
        return default_rule(fmt)
    if name in _RULE_SET:
        return name
    if not isinstance(name, str):
        raise TypeError(f"mxq: argument 'rule': expected a str or None, got {type(name).__name__}")
    n = _norm(name)
    n = _RULE_ALIASES.get(n, n)
    if n not in RULES:
        raise ValueError(f"mxq: unknown scale rule '{name}'; expected one of: {', '.join(RULES)}")
    return n


def rules_for(fmt: str) -> tuple[str, ...]:
    """The scale rules a format accepts (the library's mxq::rules_for; format aliases accepted): floor,
    ceil, even and rceil for every MX format, even_fp4 for mxfp4 and mxfp8_e4m3 as well, quest and
    qutlass_absmax for mxfp4 as well; nvfp4 and quest for nvfp4; nvfp4_e5m3 for nvfp4_e5m3. The ops refuse any
    other pairing."""
    return _RULES_OF[canonical_format(fmt)]


def rule_refusal(fmt: str, rule: str) -> str:
    """Empty when the format (a library name) accepts the rule (a library name); otherwise the library's
    reason (mxq::rule_refusal), word for word."""
    accepted = _RULES_OF[fmt]
    if rule in accepted:
        return ""
    defined_for = ", ".join(f for f in FORMATS if rule in _RULES_OF[f])
    return (f"rule '{rule}' is not defined for format '{fmt}' ({_RULE_SCOPE[rule]}; defined for {defined_for}); "
            f"{fmt} accepts {', '.join(accepted)}")


def format_info(fmt: str) -> FormatInfo:
    """FormatInfo of a format name (aliases accepted)."""
    return _INFO[canonical_format(fmt)]


def group_of(fmt: str, group_size: Optional[int]) -> int:
    return _INFO[fmt].default_group if not group_size else int(group_size)


def code_cols(fmt: str, k: int) -> int:
    """Bytes per row of packed codes: ceil(K/2) for FP4 formats, K otherwise."""
    return (k + 1) // 2 if _INFO[fmt].bits == 4 else k


def scale_cols(fmt: str, k: int, group_size: Optional[int]) -> int:
    g = group_of(fmt, group_size)
    return (k + g - 1) // g


def padded_scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """Shape of the 128x4 swizzled (or QuTLASS's padded) scale tensor of a [rows, cols] linear one."""
    return (rows + 127) // 128 * 128, (cols + 3) // 4 * 4
