#!/usr/bin/env python3
"""Runs the reference functions that mxq.compat replaces, from their own repositories at pinned
commits, on a fixed input set, and writes their outputs (with the inputs) to upstream.npz beside
this file. Their code is read from the given clones with `git show COMMIT:PATH` into a temporary
directory and run there with CPU torch; none of it is copied into mxq.

  python3 tests/known_answers/upstream/run_upstream.py \
      --neural-compressor /path/to/neural-compressor --qutlass /path/to/qutlass

(any clone or bare git directory holding the commits below). README.md beside this file records the
commits, the torch version and the command that produced upstream.npz; tests/python/test_upstream.py
reads it.

Functions run:
  vllm-qdq-plugin (intel/neural-compressor, benchmark/vllm-qdq-plugin/src/vllm_qdq_plugin/qdq/):
    mxfp4.mxfp4_qdq(x, group_size), mxfp8.mxfp8_qdq(x, group_size): the plugin's torch references
    (plain torch on any device; the CuTe kernels are separate and need a GPU).
  QuTLASS (IST-DASLab/qutlass, tests/mxfp4_test.py, tests/nvfp4_test.py): _forward_quantize_ref, the
    test suites' torch reference (with _rtne_fp4, _dq_fp4, _unpack_mask), lifted out of the test
    modules with ast (the modules import the CUDA extension at the top).
"""
import argparse
import ast
import importlib.util
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

NC_COMMIT = "9b47d09b8d135cdc73ea206e225892825ad700ca"
QT_COMMIT = "e74319e3405ce6d71965732880f5dc1f52371f64"
PLUGIN = "benchmark/vllm-qdq-plugin/src/vllm_qdq_plugin/qdq/"
HERE = os.path.dirname(os.path.abspath(__file__))


def export(repo, commit, path, tmp):
    text = subprocess.run(["git", "-C", repo, "show", f"{commit}:{path}"], check=True, capture_output=True,
                          text=True).stdout
    out = os.path.join(tmp, os.path.basename(path))
    with open(out, "w") as f:
        f.write(text)
    return out


def load_module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def lift_functions(path, names):
    """The named top-level functions of a module, executed without the module's imports (torch only)."""
    tree = ast.parse(open(path).read())
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    for n in body:
        n.decorator_list = []
    assert {n.name for n in body} == set(names), f"{path}: missing {set(names) - {n.name for n in body}}"
    ns = {"torch": torch}
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), ns)
    return ns


# ---- inputs ----------------------------------------------------------------------------------------------------
def every_pattern(dtype, g, keep=None):
    """Every finite bit pattern of a 16-bit dtype (optionally filtered), shuffled."""
    allp = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    ok = torch.isfinite(allp)
    if keep is not None:
        ok &= keep(allp)
    allp = allp[ok]
    return allp[torch.randperm(len(allp), generator=g)]


def plugin_inputs(dtype):
    """Every finite pattern of the dtype in rows of 96, then 256 LLM-like rows (a spread of row scales,
    three zero rows, some -0.0)."""
    g = torch.Generator().manual_seed(40)
    allp = every_pattern(dtype, g)
    allp = torch.cat([allp, torch.zeros(-len(allp) % 96, dtype=dtype)]).reshape(-1, 96)
    x = torch.randn(256, 96, generator=g) * torch.exp(torch.randn(256, 1, generator=g) * 3)
    x[:3] = 0
    x[3, 5:9] = -0.0
    return torch.cat([allp, x.clamp(-6e4, 6e4).to(dtype)])


def qutlass_inputs():
    """bf16 [*, 512]: Gaussian rows times 25 with all-zero blocks, +-0.0 elements and tiny rows, then every
    bf16 pattern of magnitude in (1e-30, 1e30)."""
    g = torch.Generator().manual_seed(41)
    x = torch.randn(300, 512, generator=g) * 25.0
    x[:2] = 0.0
    x[2:6, :40] = 0.0
    x[6:8, 3:9] = -0.0
    x[8:12] *= 1e-7
    allp = every_pattern(torch.bfloat16, g, lambda t: (t.abs() < 1e30) & (t.abs() > 1e-30))
    allp = allp[: len(allp) // 512 * 512].reshape(-1, 512)
    return torch.cat([x.bfloat16(), allp])


def hadamard(n):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


def u(t):
    """A tensor's raw bits as a numpy array (uint8 / uint16)."""
    t = t.contiguous()
    if t.element_size() == 2:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.view(torch.uint8).numpy()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--neural-compressor", required=True, help="a clone (or bare git dir) of intel/neural-compressor")
    ap.add_argument("--qutlass", required=True, help="a clone (or bare git dir) of IST-DASLab/qutlass")
    ap.add_argument("--out", default=os.path.join(HERE, "upstream.npz"))
    a = ap.parse_args()
    torch.manual_seed(0)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        mx4 = load_module(export(a.neural_compressor, NC_COMMIT, PLUGIN + "mxfp4.py", tmp), "plugin_mxfp4")
        mx8 = load_module(export(a.neural_compressor, NC_COMMIT, PLUGIN + "mxfp8.py", tmp), "plugin_mxfp8")
        names = ["_rtne_fp4", "_dq_fp4", "_unpack_mask", "_forward_quantize_ref"]
        qmx = lift_functions(export(a.qutlass, QT_COMMIT, "tests/mxfp4_test.py", tmp), names)
        qnv = lift_functions(export(a.qutlass, QT_COMMIT, "tests/nvfp4_test.py", tmp), names)

    for dt, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        x = plugin_inputs(dt)
        out[f"plugin_x_{name}"] = u(x)
        out[f"plugin_mxfp4_{name}"] = u(mx4.mxfp4_qdq(x))
        out[f"plugin_mxfp8_{name}"] = u(mx8.mxfp8_qdq(x))
        llm = x[-256:]
        for gs in (16, 64):
            out[f"plugin_mxfp4_{name}_g{gs}"] = u(mx4.mxfp4_qdq(llm, gs))
            out[f"plugin_mxfp8_{name}_g{gs}"] = u(mx8.mxfp8_qdq(llm, gs))

    x = qutlass_inputs()
    out["qutlass_x"] = u(x)
    for rs, h in (("id", torch.eye(32, dtype=torch.bfloat16)), ("had32", (hadamard(32) * 32 ** -0.5).bfloat16())):
        for method, quest in (("quest", True), ("abs_max", False)):
            _, _, (codes, e8m0, mask) = qmx["_forward_quantize_ref"](x, h, 32, quest=quest)
            out[f"qutlass_mx_{method}_{rs}_codes"] = u(codes)
            out[f"qutlass_mx_{method}_{rs}_scales"] = u(e8m0.view(torch.uint8))
            out[f"qutlass_mx_{method}_{rs}_mask"] = u(mask)
    _, _, (codes, e4m3, mask) = qnv["_forward_quantize_ref"](x, torch.eye(16, dtype=torch.bfloat16), 16)
    out["qutlass_nv_id_codes"] = u(codes)
    out["qutlass_nv_id_scales"] = u(e4m3.view(torch.uint8))
    out["qutlass_nv_id_mask"] = u(mask)
    np.savez_compressed(a.out, **out)
    print(f"wrote {a.out} ({os.path.getsize(a.out)} bytes) with torch {torch.__version__}; "
          f"neural-compressor {NC_COMMIT}, qutlass {QT_COMMIT}")


if __name__ == "__main__":
    main()
