"""`mxq quantize` checkpoints against the real consumers: compressed-tensors decompresses every format
to exactly `mxq dequantize`'s values, its own MX quantization writes the same scale and code bytes,
and transformers loads the output with logits equal to those of `mxq qdq`'s fake-quantized copy.

The model is a tiny Llama built here from a config with random weights (no download), saved as
safetensors the way transformers saves it. The tool is the one the build made: $MXQ_TOOL, else
tools/mxq/mxq under $MXQ_LIBMXQ_BUILD_DIR, build-ci, build or build-cpu. The tests skip when
compressed-tensors, transformers or the tool are missing, unless MXQ_REQUIRE_CONSUMERS=1
(scripts/test-python sets it: CI installs them and must run these tests)."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import assert_bytes_equal

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = os.environ.get("MXQ_REQUIRE_CONSUMERS") == "1"


def _need(module: str):
    """The module; a skip when it is missing, or an error where CI requires it."""
    return importlib.import_module(module) if REQUIRED else pytest.importorskip(module)


def _tool() -> Path:
    cands = [os.environ.get("MXQ_TOOL")]
    cands += [str(Path(d) / "tools/mxq/mxq") for d in (os.environ.get("MXQ_LIBMXQ_BUILD_DIR"),) if d]
    cands += [str(ROOT / d / "tools/mxq/mxq") for d in ("build-ci", "build", "build-cpu")]
    for c in cands:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return Path(c)
    if REQUIRED:
        pytest.fail(f"the mxq tool is not built (looked at {', '.join(c for c in cands if c)})")
    pytest.skip("the mxq tool is not built (set MXQ_TOOL)")


def mxq(*args: str) -> str:
    r = subprocess.run([str(_tool()), *args], capture_output=True, text=True)
    assert r.returncode == 0, f"mxq {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r.stdout


def tiny_llama(path: Path, dtype: torch.dtype, drop_torch_dtype: bool = False) -> None:
    """A 2-layer Llama (hidden 64, MLP 128, GQA) with random weights, saved as safetensors."""
    transformers = _need("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():  # real-looking spread: a few outlier input channels per weight
        for name, p in model.named_parameters():
            if p.dim() == 2 and "proj" in name:
                p[:, ::17] *= 8
    model.save_pretrained(path, safe_serialization=True)
    if drop_torch_dtype:
        cfg_path = path / "config.json"
        c = json.loads(cfg_path.read_text())
        c.pop("torch_dtype", None)
        c.pop("dtype", None)
        cfg_path.write_text(json.dumps(c))


def load(path: Path):
    transformers = _need("transformers")
    _need("compressed_tensors")
    kw = {}
    if "quantization_config" in json.loads((path / "config.json").read_text()):
        # decompress into plain Linear modules (compressed-tensors does it), instead of running compressed
        kw["quantization_config"] = transformers.utils.quantization_config.CompressedTensorsConfig(run_compressed=False)
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kw).eval()


def linear_weights(model) -> dict:
    return {n + ".weight": m.weight.detach() for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n != "lm_head"}


def read_safetensors(path: Path) -> dict:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


FORMATS = ["mxfp4", "nvfp4", "mxfp8"]


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama-bf16")
    tiny_llama(d, torch.bfloat16)
    return d


@pytest.mark.parametrize("fmt", FORMATS)
def test_compressed_tensors_decompresses_to_mxq_dequantize(bf16_model, tmp_path, fmt):
    q, dq = tmp_path / "q", tmp_path / "dq"
    mxq("quantize", str(bf16_model), "-o", str(q), "--format", fmt, "--device", "cpu")
    mxq("dequantize", str(q), "-o", str(dq), "--dtype", "bf16", "--device", "cpu")
    ours = read_safetensors(dq)
    model = load(q)
    got = linear_weights(model)
    assert len(got) == 2 * 7
    for name, w in got.items():
        assert_bytes_equal(w.to(torch.bfloat16), ours["model." + name] if "model." + name in ours else ours[name],
                           f"{fmt} {name}: compressed-tensors vs mxq dequantize")


@pytest.mark.parametrize("fmt", FORMATS)
def test_transformers_logits_equal_mxq_qdq(bf16_model, tmp_path, fmt):
    q, fake = tmp_path / "q", tmp_path / "qdq"
    mxq("quantize", str(bf16_model), "-o", str(q), "--format", fmt, "--device", "cpu")
    mxq("qdq", str(bf16_model), "-o", str(fake), "--format", fmt, "--device", "cpu")
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = load(q)(ids).logits
        b = load(fake)(ids).logits
    assert a.dtype == b.dtype == torch.bfloat16
    assert_bytes_equal(a, b, f"{fmt}: logits of the checkpoint vs of mxq qdq")


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_mx_scales_and_codes_equal_compressed_tensors_quantization(bf16_model, tmp_path, fmt):
    """compressed-tensors' own MX quantization (calculate_qparams, then its compressor) of every weight
    gives the bytes `mxq quantize` wrote: its MXFP8 scale rule is even_fp4, mxq's default."""
    _need("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, QuantizationStrategy
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from compressed_tensors.compressors import BaseCompressor

    q = tmp_path / "q"
    mxq("quantize", str(bf16_model), "-o", str(q), "--format", fmt, "--device", "cpu")
    ours = read_safetensors(q)
    orig = read_safetensors(bf16_model)
    ct_format = {"mxfp4": "mxfp4-pack-quantized", "mxfp8": "mxfp8-quantized"}[fmt]
    args = QuantizationArgs(num_bits=4 if fmt == "mxfp4" else 8, type="float", strategy=QuantizationStrategy.GROUP,
                            group_size=32, scale_dtype=torch.uint8, zp_dtype=torch.uint8, symmetric=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format=ct_format)
    compressor = BaseCompressor.load_from_registry(ct_format)
    n = 0
    for name, w in orig.items():
        mod = name[: -len(".weight")]
        if mod + ".weight_scale" not in ours:
            continue
        rows, cols = w.shape
        g = w.reshape(rows, cols // 32, 32)
        scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
        ct = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme=scheme)
        assert_bytes_equal(ours[mod + ".weight_scale"], ct["weight_scale"].to(torch.uint8), f"{fmt} {mod} scales")
        codes = ct["weight_packed"] if fmt == "mxfp4" else ct["weight"]
        assert_bytes_equal(ours[mod + (".weight_packed" if fmt == "mxfp4" else ".weight")], codes, f"{fmt} {mod} codes")
        n += 1
    assert n == 2 * 7


def test_f32_model_without_torch_dtype_loads_and_runs(tmp_path):
    """An F32 checkpoint whose config.json has no torch_dtype: quantize writes the dtype the
    decompressed weights have, so that transformers' first forward pass does not mix dtypes."""
    src, q = tmp_path / "f32", tmp_path / "q"
    tiny_llama(src, torch.float32, drop_torch_dtype=True)
    mxq("quantize", str(src), "-o", str(q), "--format", "mxfp4", "--device", "cpu")
    cfg = json.loads((q / "config.json").read_text())
    assert cfg.get("torch_dtype") == "bfloat16", cfg
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = load(q)(ids).logits
    assert torch.isfinite(logits).all()
