#!/usr/bin/env python3
"""Apply small deliberate bugs (mutations) to a scratch copy of this tree, one at a time, and report
which ones the tests let through.

  python3 dev/mutation-check.py                 # every mutation, the whole suite (ctest + pytest)
  python3 dev/mutation-check.py --subset        # the tests most likely to catch them (seconds per mutation)
  python3 dev/mutation-check.py --only swizzle-rows-5-6,nvfp4-scale-reciprocal --subset
  python3 dev/mutation-check.py --list

The scratch copy (default build-mutants/, ignored by git) holds the tracked and untracked files of
the working tree and a CPU-only CMake build (ccache when found). C++ mutations are built and run
through ctest; the Python tests run against the scratch copy's python/ with the compiled extension
mxq._C built in place there (setup.py build_ext --inplace, linking the scratch build's libmxq.a), so
they see the mutated Python and C++ alike. A mutation is "caught" when at least one test fails;
one that no longer applies (its text is not found) is reported as stale, never as caught.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name: (what it breaks, [(file, old text, new text, count: 0 = every occurrence)])
MUTATIONS = {
    "sr-counter-plus-one": (
        "stochastic rounding's counter shifted by one (offset + i -> offset + i + 1), reference and fast path",
        [("src/cpu/reference/reference.cpp", "p.opt.offset + r * p.K + k,", "p.opt.offset + r * p.K + k + 1,", 0),
         ("src/cpu/common/sr_words.hpp", "base_(p.opt.offset + std::uint64_t(r * p.K))",
          "base_(p.opt.offset + std::uint64_t(r * p.K) + 1)", 1)]),
    "quantize-drops-stochastic": (
        "mxq.quantize ignores stochastic=True",
        [("python/mxq/ops.py", "xin, fmt, r, 0 if group_size is None else _group(group_size), bool(stochastic),",
          "xin, fmt, r, 0 if group_size is None else _group(group_size), False,", 1)]),
    "quantize-drops-offset": (
        "mxq.quantize ignores offset",
        [("python/mxq/ops.py", 'offset if type(offset) is int and 0 <= offset < _I63 else _u64(offset, "offset"), layout,',
          "0, layout,", 1)]),
    "quantize-drops-rotation-seed": (
        "mxq.quantize ignores rotation_seed",
        [("python/mxq/ops.py", 'extra = (int(random_bits), rot, _u64(rotation_seed, "rotation_seed"))',
          "extra = (int(random_bits), rot, 0)", 1)]),
    "qdq-drops-random-bits": (
        "mxq.qdq / qdq_ ignore random_bits",
        [("python/mxq/ops.py", 'args += (int(random_bits), _rotation(rotation), _u64(rotation_seed, "rotation_seed"))',
          'args += (32, _rotation(rotation), _u64(rotation_seed, "rotation_seed"))', 1)]),
    "quantize-drops-group-size": (
        "mxq.quantize ignores group_size",
        [("python/mxq/ops.py", "xin, fmt, r, 0 if group_size is None else _group(group_size), bool(stochastic),",
          "xin, fmt, r, 0, bool(stochastic),", 1)]),
    "qdq-drops-tensor-scale": (
        "mxq.qdq / qdq_ ignore tensor_scale",
        [("python/mxq/ops.py", "None if tensor_scale is None else _scale_value(tensor_scale))", "None)", 1)]),
    "dequantize-drops-tensor-scale": (
        "mxq.dequantize of raw codes ignores a float tensor_scale (uses 1)",
        [("python/mxq/ops.py", "        ts_f = _scale_value(tensor_scale)\n",
          "        ts_f = None if tensor_scale is None else 1.0\n", 1)]),
    "qutlass-nv-drops-global-scale": (
        "compat.qutlass.fusedQuantizeNv ignores global_scale (uses 6)",
        [("python/mxq/compat/qutlass.py", '"padded", gs, False)', '"padded", 6.0, False)', 1)]),
    "swizzle-rows-5-6": (
        "rows 5 and 6 of every 32-row stripe of the 128x4 swizzled layout exchanged (swizzled_offset)",
        [("include/mxq/ops.hpp", "(r % 32) * 16", "((r % 32) == 5 ? 6 : (r % 32) == 6 ? 5 : (r % 32)) * 16", 1)]),
    "vllm-mxfp8-ignores-group-size": (
        "compat.vllm_qdq.mxfp8_qdq ignores group_size",
        [("python/mxq/compat/vllm_qdq.py", '"mxfp8_e4m3", "floor", _ops._group(group_size)',
          '"mxfp8_e4m3", "floor", 32', 1)]),
    "nvfp4-scale-reciprocal": (
        "the NVFP4 tensor scale computed as 2688 * (1 / amax) instead of 2688 / amax",
        [("src/core/codec.hpp", "div_rn(448.0f * 6.0f, u2f(a))", "mul_rn(448.0f * 6.0f, div_rn(1.0f, u2f(a)))", 1)]),
    "philox-nine-rounds": (
        "Philox4x32 with 9 rounds instead of 10",
        [("src/core/codec.hpp", "for (int r = 0; r < 10; ++r) {\n    const std::uint64_t p0",
          "for (int r = 0; r < 9; ++r) {\n    const std::uint64_t p0", 1)]),
    "sr-16bit-fields-swapped": (
        "16 random bits: the two fields of a word taken high half first",
        [("src/core/codec.hpp", "return B == 32 ? w : sr_word((w >> (k * B)) & ((1u << B) - 1u), B);",
          "return B == 32 ? w : sr_word((w >> ((B == 16 ? 1 - k : k) * B)) & ((1u << B) - 1u), B);", 1)]),
}

# The tests most likely to catch these (--subset): ctest names (a regex) and pytest files.
SUBSET_CTEST = r"KnownAnswer|Codec\.|Layout"
SUBSET_PYTEST = ["tests/python/test_known_answers.py", "tests/python/test_arguments.py"]
SUBSET_TARGETS = ["mxq", "known_answer_test", "codec_test", "layout_test"]  # what --subset builds


def run(cmd, cwd, env=None, log=None):
    p = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if log is not None:
        log.write(f"$ {' '.join(map(str, cmd))}\n{p.stdout}\n")
        log.flush()
    return p.returncode, p.stdout


def copy_tree(dst: Path):
    """Brings dst up to date with the working tree's tracked and untracked files. A file is rewritten only
    when its bytes differ, and then gets a new modification time: the scratch build rebuilds what changed
    (a file restored after a mutation included) and nothing else."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.split(b"\0")
    for f in files:
        if not f:
            continue
        rel = f.decode()
        src = ROOT / rel
        if not src.is_file():
            continue
        out = dst / rel
        data = src.read_bytes()
        if out.is_file() and out.read_bytes() == data:
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)
        shutil.copymode(src, out)


def apply(src: Path, edits):
    """Apply the edits; returns the original texts to restore, or None when one no longer applies."""
    saved = {}
    for rel, old, new, count in edits:
        p = src / rel
        text = p.read_text()
        saved.setdefault(rel, text)
        if old not in text:
            for r, t in saved.items():
                (src / r).write_text(t)
            return None
        p.write_text(text.replace(old, new) if count == 0 else text.replace(old, new, count))
    return saved


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--subset", action="store_true", help=f"ctest -R '{SUBSET_CTEST}' and pytest "
                    f"{' '.join(SUBSET_PYTEST)} instead of everything")
    ap.add_argument("--ctest-regex", help="ctest -R this (overrides --subset's)")
    ap.add_argument("--pytest", nargs="*", help="these pytest files or node ids (overrides --subset's)")
    ap.add_argument("--no-python", action="store_true", help="ctest only (CI's CPU-only ctest alone)")
    ap.add_argument("--only", help="comma-separated mutation names")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--scratch", default=str(ROOT / "build-mutants"))
    ap.add_argument("--python", default=None, help="the Python with torch and pytest (default: build-py/venv's, "
                    "else python3)")
    ap.add_argument("-j", type=int, default=os.cpu_count() or 2)
    a = ap.parse_args()

    if a.list:
        for n, (what, _) in MUTATIONS.items():
            print(f"{n:32s} {what}")
        return 0
    names = a.only.split(",") if a.only else list(MUTATIONS)
    for n in names:
        if n not in MUTATIONS:
            sys.exit(f"unknown mutation {n!r} (--list)")
    ctest_re = a.ctest_regex if a.ctest_regex is not None else (SUBSET_CTEST if a.subset else None)
    pytests = a.pytest if a.pytest is not None else (SUBSET_PYTEST if a.subset else ["tests/python"])
    py = a.python or (str(ROOT / "build-py/venv/bin/python") if (ROOT / "build-py/venv/bin/python").exists()
                      else "python3")

    scratch = Path(a.scratch)
    src, build = scratch / "src", scratch / "build"
    scratch.mkdir(parents=True, exist_ok=True)
    log = open(scratch / "log.txt", "w")
    print(f"scratch copy: {src} (log: {scratch / 'log.txt'})", flush=True)
    copy_tree(src)
    env = dict(os.environ)
    env.setdefault("CCACHE_BASEDIR", str(ROOT.parent))
    env.setdefault("CCACHE_NOHASHDIR", "1")
    cfg = ["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
           "-DMXQ_ENABLE_CUDA=OFF"]
    if shutil.which("ccache"):
        cfg.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
    if run(cfg, ROOT, env, log)[0]:
        sys.exit("cmake configure failed (see the log)")

    def build_and_test(label):
        """(ctest verdict, pytest verdict): 'caught (n failed)', 'survived', 'build failed', '-'"""
        t0 = time.time()
        targets = ["--target", *SUBSET_TARGETS] if ctest_re == SUBSET_CTEST else []
        rc, _ = run(["nice", "cmake", "--build", str(build), "-j", str(a.j), *targets], ROOT, env, log)
        if rc:
            return "build failed", "-", time.time() - t0
        cmd = ["ctest", "--test-dir", str(build), "-j", str(a.j)]
        if ctest_re:
            cmd += ["-R", ctest_re]
        rc, out = run(cmd, ROOT, env, log)
        m = re.search(r"(\d+) tests failed out of (\d+)", out)
        if m:
            cv = f"caught ({m.group(1)} of {m.group(2)} failed)" if rc else "survived"
        else:
            m = re.search(r"100% tests passed, 0 tests failed out of (\d+)", out)
            cv = "survived" if rc == 0 else "ctest error"
            if m:
                cv += f" ({m.group(1)} ran)"
        if a.no_python:
            return cv, "-", time.time() - t0
        penv = dict(env, MXQ_LIBMXQ_BUILD_DIR=str(build), MXQ_ENABLE_CUDA="0", PYTHONPATH=str(src / "python"))
        rc, _ = run([py, "setup.py", "-q", "build_ext", "--inplace"], src, penv, log)
        if rc:
            return cv, "extension build failed", time.time() - t0
        rc, out = run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytests], src, penv, log)
        m = re.search(r"(\d+) failed", out)
        pv = f"caught ({m.group(1)} failed)" if m and rc else ("survived" if rc == 0 else f"pytest error rc={rc}")
        return cv, pv, time.time() - t0

    print("baseline (no mutation) ...", flush=True)
    base = build_and_test("baseline")
    base_ok = base[0].startswith("survived") and base[1] in ("survived", "-")
    base = tuple(v.replace("survived", "passed") if isinstance(v, str) else v for v in base)
    print(f"  baseline: ctest {base[0]}, pytest {base[1]} ({base[2]:.0f} s)", flush=True)
    if not base_ok:
        sys.exit("the unmutated copy fails its tests: fix that first (see the log)")
    rows = []
    for n in names:
        what, edits = MUTATIONS[n]
        saved = apply(src, edits)
        if saved is None:
            rows.append((n, "stale (text not found)", "-", 0))
            print(f"  {n}: stale", flush=True)
            continue
        try:
            cv, pv, dt = build_and_test(n)
        finally:
            for rel, text in saved.items():
                (src / rel).write_text(text)
        rows.append((n, cv, pv, dt))
        print(f"  {n}: ctest {cv}; pytest {pv} ({dt:.0f} s)", flush=True)

    print("\nmutation                        | ctest" + (f" -R '{ctest_re}'" if ctest_re else " (all)") +
          " | pytest " + " ".join(pytests))
    survived = 0
    for n, cv, pv, _ in rows:
        caught = cv.startswith("caught") or pv.startswith("caught")
        survived += not caught
        print(f"{n:32s}| {cv:30s}| {pv:24s}| {'CAUGHT' if caught else 'SURVIVED'}")
    print(f"{len(rows) - survived} of {len(rows)} caught; baseline: ctest {base[0]}, pytest {base[1]}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
