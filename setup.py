"""Build of mxq's PyTorch package: `pip install --no-build-isolation .` (or plain `pip install .`).

build_ext first builds the C++ library libmxq with CMake (static, position-independent; no tests,
tools, benchmarks or examples) into build-py/, then compiles python/csrc/ops.cpp (and, with CUDA,
python/csrc/hadamard_rotate.cu) against the installed torch with torch.utils.cpp_extension and links
libmxq into the extension mxq._C.

Environment:
  MXQ_ENABLE_CUDA         auto (default: when torch has CUDA and nvcc is found), 1 (required) or 0
  MXQ_CUDA_ARCHITECTURES  CUDA architectures of the kernels (default "80;89;90a"; with MXQ_LIBMXQ_BUILD_DIR,
                          that build's for the extension's own .cu file)
  MAX_JOBS                parallel compile jobs (default: every core), as torch's extensions use it
  CMAKE                   the cmake executable (default: cmake on PATH)
  MXQ_LIBMXQ_BUILD_DIR    link the libmxq.a of this existing CMake build of mxq (e.g. the build dir of
                          scripts/test) instead of building one; CUDA is on when that library has it
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup

import torch
from torch.utils import cpp_extension as tce

ROOT = Path(__file__).resolve().parent
DEFAULT_ARCHS = "80;89;90a"


def _version() -> str:
    m = re.search(r"project\(mxq VERSION ([0-9.]+)", (ROOT / "CMakeLists.txt").read_text())
    return m.group(1) if m else "0.0.0"


def _want_cuda() -> bool:
    v = os.environ.get("MXQ_ENABLE_CUDA", "auto").strip().lower()
    have = torch.version.cuda is not None and tce.CUDA_HOME is not None
    if v in ("0", "off", "false", "no"):
        return False
    if v in ("1", "on", "true", "yes"):
        if not have:
            sys.exit(
                "mxq: MXQ_ENABLE_CUDA=1 but "
                + ("this torch has no CUDA" if torch.version.cuda is None else "no CUDA toolkit (nvcc) was found")
            )
        return True
    if v != "auto":
        sys.exit(f"mxq: MXQ_ENABLE_CUDA={v!r}, expected auto, 1 or 0")
    return have


def _prebuilt():
    d = os.environ.get("MXQ_LIBMXQ_BUILD_DIR")
    if not d:
        return None
    lib = Path(d) / "libmxq.a"
    if not lib.exists():
        sys.exit(f"mxq: MXQ_LIBMXQ_BUILD_DIR={d}: no libmxq.a there (a static build of mxq)")
    members = subprocess.run(["ar", "t", str(lib)], check=True, capture_output=True, text=True).stdout.split()
    cuda = any(m.endswith(".cu.o") for m in members)
    if cuda and torch.version.cuda is None:
        sys.exit(f"mxq: {lib} has the CUDA backend but this torch has no CUDA")
    return lib, cuda


PREBUILT = _prebuilt()
WITH_CUDA = PREBUILT[1] if PREBUILT else _want_cuda()
TORCH_VERSION = torch.__version__.split("+")[0]


def _jobs() -> int:
    try:
        return max(1, int(os.environ["MAX_JOBS"]))
    except (KeyError, ValueError):
        return os.cpu_count() or 1


class BuildExt(tce.BuildExtension):
    """Builds libmxq with CMake, then the extension that links it."""

    def build_extensions(self):
        lib, link_flags = self._build_libmxq()
        for ext in self.extensions:
            ext.extra_objects.append(str(lib))
            ext.extra_link_args.extend(link_flags)
        super().build_extensions()

    def _build_libmxq(self):
        if PREBUILT:
            print(f"mxq: linking the prebuilt {PREBUILT[0]} (CUDA: {PREBUILT[1]})", flush=True)
            return PREBUILT[0], self._openmp_flags(PREBUILT[0].parent)
        cmake = os.environ.get("CMAKE") or shutil.which("cmake")
        if not cmake:
            sys.exit("mxq: cmake (>= 3.24) is needed to build libmxq; install it (apt, or pip install cmake)")
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        tag = ("cuda" if WITH_CUDA else "cpu") + ("-ninja" if gen else "-make")
        bdir = ROOT / "build-py" / f"libmxq-{tag}"
        archs = os.environ.get("MXQ_CUDA_ARCHITECTURES", DEFAULT_ARCHS)
        args = [
            cmake, "-S", str(ROOT), "-B", str(bdir), *gen,
            "-DCMAKE_BUILD_TYPE=Release",
            "-DBUILD_SHARED_LIBS=OFF",
            "-DCMAKE_POSITION_INDEPENDENT_CODE=ON",
            "-DMXQ_BUILD_TESTS=OFF", "-DMXQ_BUILD_TOOLS=OFF", "-DMXQ_BUILD_BENCH=OFF", "-DMXQ_BUILD_EXAMPLES=OFF",
            "-DMXQ_ENABLE_CUDA=" + ("ON" if WITH_CUDA else "OFF"),
        ]
        if WITH_CUDA:
            args += [f"-DMXQ_CUDA_ARCHITECTURES={archs}",
                     f"-DCMAKE_CUDA_COMPILER={Path(tce.CUDA_HOME) / 'bin' / 'nvcc'}"]
        print(f"mxq: building libmxq ({'CUDA ' + archs if WITH_CUDA else 'CPU only'}) in {bdir}", flush=True)
        subprocess.run(args, check=True)
        subprocess.run([cmake, "--build", str(bdir), "--target", "mxq", "-j", str(_jobs())], check=True)
        lib = bdir / "libmxq.a"
        if not lib.exists():
            sys.exit(f"mxq: the CMake build did not produce {lib}")
        return lib, self._openmp_flags(bdir)

    @staticmethod
    def _openmp_flags(bdir: Path):
        """libmxq links OpenMP privately; a static archive leaves that to the extension. The extension
        links the OpenMP runtime that torch itself loaded when it provides every OpenMP entry point
        libmxq calls, so that a process holds one runtime (one thread pool, which torch.set_num_threads
        configures); otherwise the compiler's flags (its own runtime)."""
        cache = bdir / "CMakeCache.txt"
        m = re.search(r"^OpenMP_CXX_FLAGS:STRING=(.*)$", cache.read_text(), re.M) if cache.exists() else None
        flags = m.group(1).split() if m and m.group(1) else []
        if not flags:
            return []
        runtime, why = _torch_openmp_runtime(bdir / "libmxq.a")
        if runtime is None:
            print(f"mxq: OpenMP: the compiler's runtime ({' '.join(flags)}): {why}", flush=True)
            return flags
        print(f"mxq: OpenMP: linking torch's runtime {runtime}", flush=True)
        rpath = [str(runtime.parent)]
        torch_lib = Path(torch.__file__).resolve().parent / "lib"
        if runtime.parent == torch_lib:  # installed side by side in site-packages: found relative to mxq/
            rpath.insert(0, "$ORIGIN/../torch/lib")
        return [str(runtime), "-pthread", "-Wl,-rpath," + ":".join(rpath)]


_OMP_RUNTIME = re.compile(r"^lib(gomp|iomp5|omp)([-.][^/]*)?\.so(\.[0-9]+)*$")


def _torch_openmp_runtime(archive: Path):
    """(path, None) of the OpenMP runtime torch loaded (read from /proc/self/maps: setup.py has imported
    torch) if it defines every GOMP_*/omp_* symbol the archive needs, else (None, the reason).

    NOTE: torch's wheels bundle their own libgomp. Where its soname is libgomp.so.1 (as the system's)
    the dynamic loader reuses whichever was loaded first and a process holds one runtime anyway, but
    wheels whose bundled copy has another soname (libgomp-<hash>.so.1) next to an extension linked with
    -fopenmp (the system's libgomp.so.1) load two: two thread pools, and torch.set_num_threads does not
    reach mxq's. Linking the file torch loaded (its soname, found through the rpath) avoids that."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None, "no /proc/self/maps (not Linux)"
    loaded = {line.split(None, 5)[5] for line in maps.splitlines() if len(line.split(None, 5)) == 6}
    runtimes = sorted({p for p in loaded if _OMP_RUNTIME.match(Path(p).name)})
    if len(runtimes) != 1:
        return None, f"torch loaded {len(runtimes)} OpenMP runtimes ({', '.join(runtimes) or 'none'})"
    runtime = Path(runtimes[0])
    nm = shutil.which("nm")
    if not nm or not archive.exists():
        return None, "no nm to compare symbols" if not nm else f"no {archive}"
    try:
        need = subprocess.run([nm, "-u", str(archive)], check=True, capture_output=True, text=True).stdout
        have = subprocess.run([nm, "-D", "--defined-only", str(runtime)], check=True, capture_output=True,
                              text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        return None, f"nm failed: {e}"
    need = {ln.split()[-1] for ln in need.splitlines() if re.search(r"\b(GOMP|omp)_\w+$", ln)}
    have = {ln.split()[-1].split("@")[0] for ln in have.splitlines() if ln.strip()}
    missing = sorted(need - have)
    if missing:
        return None, f"{runtime} lacks {', '.join(missing)}"
    return runtime, None


def _nvcc_arch_flags():
    """-gencode flags for the extension's own CUDA file: MXQ_CUDA_ARCHITECTURES, else the prebuilt
    libmxq's (its CMakeCache), else DEFAULT_ARCHS, in CMake's spelling ("80;89;90a", "-real" /
    "-virtual" suffixes). Anything else ("native", "all"): none given, torch's defaults
    (TORCH_CUDA_ARCH_LIST or the visible GPUs) apply."""
    archs = os.environ.get("MXQ_CUDA_ARCHITECTURES")
    if not archs and PREBUILT:
        cache = PREBUILT[0].parent / "CMakeCache.txt"
        m = re.search(r"^MXQ_CUDA_ARCHITECTURES:STRING=(.*)$", cache.read_text(), re.M) if cache.exists() else None
        archs = m.group(1).strip() if m else None
    flags = []
    for a in (archs or DEFAULT_ARCHS).replace(",", ";").split(";"):
        m = re.fullmatch(r"([0-9]+[af]?)(-real|-virtual)?", a.strip())
        if not m:
            return []
        code = f"compute_{m.group(1)}" if m.group(2) == "-virtual" else f"sm_{m.group(1)}"
        flags.append(f"-gencode=arch=compute_{m.group(1)},code={code}")
    return flags


def _extension():
    cxx = ["-O2", "-std=c++20", "-ffp-contract=off", "-fno-fast-math", "-Wall"]
    kw = dict(
        name="mxq._C",
        sources=["python/csrc/ops.cpp"],
        include_dirs=[str(ROOT / "include")],
        extra_compile_args={"cxx": cxx},
    )
    if WITH_CUDA:
        # python/csrc/hadamard_rotate.cu: the kernel of torch.ops.mxq.hadamard_rotate_f64 (the QuTLASS
        # shim's rotation), compiled here by nvcc for the architectures of libmxq's kernels
        kw["sources"].append("python/csrc/hadamard_rotate.cu")
        kw["extra_compile_args"]["nvcc"] = ["-O3", "--fmad=false", *_nvcc_arch_flags()]
        return tce.CUDAExtension(define_macros=[("MXQ_TORCH_CUDA", "1")], **kw)
    return tce.CppExtension(**kw)


setup(
    name="mxq",
    version=_version(),
    description="Microscaling formats (MXFP4, MXFP6, MXFP8, MXINT8, NVFP4) for PyTorch: quantize, "
    "dequantize, QDQ, scale swizzling; bit-exact on CPU and CUDA",
    long_description=(ROOT / "docs" / "python.md").read_text() if (ROOT / "docs" / "python.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages("python"),
    package_dir={"": "python"},
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExt.with_options(use_ninja=shutil.which("ninja") is not None)},
    # The extension is compiled against this torch's C++ ABI: it only loads with the same version.
    install_requires=[f"torch=={TORCH_VERSION}"],
    options={"build": {"build_base": "build-py"}},
    zip_safe=False,
)
