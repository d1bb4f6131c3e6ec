"""One OpenMP runtime per process: the extension links the runtime torch loaded (setup.py,
_torch_openmp_runtime), so mxq's CPU threads and torch's are one pool that torch.set_num_threads
configures. Linux only (/proc/self/maps, ldd)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import mxq

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")

_RUNTIME = re.compile(r"^lib(gomp|iomp5|omp)([-.][^/]*)?\.so(\.[0-9]+)*$")


def _runtimes(maps: str) -> set:
    out = set()
    for line in maps.splitlines():
        f = line.split(None, 5)
        if len(f) == 6 and _RUNTIME.match(os.path.basename(f[5])):
            out.add(os.path.realpath(f[5]))
    return out


def test_one_openmp_runtime_after_torch_and_mxq_ran():
    """A fresh process that imports torch and mxq and runs both on the CPU (multi-threaded) maps one
    OpenMP runtime, not two."""
    code = (
        "import torch, mxq\n"
        "x = torch.randn(2048, 4096)\n"
        "mxq.qdq(x, 'mxfp4'); mxq.quantize(x, 'nvfp4', layout='swizzled'); (x @ x[:512].t()).sum()\n"
        "print(open('/proc/self/maps').read())\n")
    env = dict(os.environ, OMP_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env).stdout
    rt = _runtimes(out)
    assert len(rt) <= 1, f"{len(rt)} OpenMP runtimes loaded: {sorted(rt)}"


def test_extension_names_torchs_openmp_runtime():
    """ldd on mxq's extension resolves its OpenMP runtime to the file torch loaded, so that no import
    order (or a torch whose bundled runtime has its own soname) can bring in a second one."""
    ldd = shutil.which("ldd")
    if not ldd:
        pytest.skip("no ldd")
    torch_rt = _runtimes(open("/proc/self/maps").read())
    if len(torch_rt) != 1:
        pytest.skip(f"torch loaded {len(torch_rt)} OpenMP runtimes here")
    out = subprocess.run([ldd, mxq._C.__file__], check=True, capture_output=True, text=True).stdout
    deps = {}
    for line in out.splitlines():
        m = re.match(r"\s*(\S+)\s+=>\s+(\S+)", line)
        if m:
            deps[m.group(1)] = m.group(2)
    omp = {k: v for k, v in deps.items() if _RUNTIME.match(k)}
    if not omp:
        pytest.skip("this build of mxq links no OpenMP runtime")
    assert len(omp) == 1, omp
    (name, path), = omp.items()
    assert path != "not" and os.path.exists(path), f"{name} is not found next to the extension: {out}"
    assert os.path.realpath(path) == next(iter(torch_rt)), \
        f"the extension's {name} resolves to {path}, torch's runtime is {next(iter(torch_rt))}"

