"""Fetch FlashInfer's headers (where PyPI is reachable) and build decode.cu against them (where nvcc
is), one shared library per (query dtype, KV dtype).

    python experiments/gpu/flashinfer_peer/build.py fetch [--dest .flashinfer]
    python experiments/gpu/flashinfer_peer/build.py build --src .flashinfer [--arch sm_90]

`fetch` downloads the `flashinfer-python` wheel (pure Python, ~62 MB: FlashInfer JIT-compiles its
kernels from the sources it ships) with `pip download --no-deps`, and keeps only what the decode
kernel includes: `flashinfer/data/include` (FlashInfer's headers, ~6 MB) and the libcudacxx headers
of the CCCL it ships (`flashinfer/data/cccl/libcudacxx/include`, ~15 MB; its headers need a newer
`<cuda/cmath>` than CUDA 13.0's). The ~21 MB folder is what a GPU session carries (the machine has
no network). `build` compiles with FlashInfer's own JIT flags (`--expt-relaxed-constexpr`,
`-static-global-template-stub=false`), every configuration the bench may use at once (the bench also
builds one on first use); a library is cached under `<src>/build/` by a hash of the source and flags.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

FLASHINFER_VERSION = "0.7.2.post1"
SOURCE = Path(__file__).resolve().parent / "decode.cu"
# wheel member prefix -> folder under the fetched source
MEMBERS = {"flashinfer/data/include/": "include/", "flashinfer/data/cccl/libcudacxx/include/": "libcudacxx/include/"}
# torch dtype names -> the CUDA types FlashInfer's templates take
CUDA_TYPES = {"float16": "half", "bfloat16": "__nv_bfloat16", "float8_e4m3fn": "__nv_fp8_e4m3",
              "float8_e5m2": "__nv_fp8_e5m2"}
HEAD_DIM = 128
NVCC_TIMEOUT_S = 600


def fetch(dest: Path) -> None:
    """Download the pinned wheel and extract the headers decode.cu needs into `dest`."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp,
                        f"flashinfer-python=={FLASHINFER_VERSION}"], check=True)
        wheel = next(Path(tmp).glob("flashinfer_python-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.namelist():
                for prefix, folder in MEMBERS.items():
                    if member.startswith(prefix) and not member.endswith("/"):
                        target = dest / folder / member[len(prefix):]
                        target.parent.mkdir(parents=True, exist_ok=True)
                        target.write_bytes(archive.read(member))
    (dest / "VERSION").write_text(f"flashinfer-python {FLASHINFER_VERSION}\n")


def source_problem(src: Path | None) -> str | None:
    """Why `src` cannot be built from, or None."""
    if src is None:
        return "no --flashinfer-src (python experiments/gpu/flashinfer_peer/build.py fetch makes one)"
    if not (src / "include" / "flashinfer" / "attention" / "decode.cuh").is_file():
        return f"{src} has no include/flashinfer/attention/decode.cuh (build.py fetch makes it)"
    if shutil.which("nvcc") is None:
        return "no nvcc on PATH"
    return None


def build(src: Path, query_dtype: str, kv_dtype: str, arch: str) -> Path:
    """The shared library for one configuration, compiled unless cached; raises with nvcc's output."""
    flags = ["-std=c++17", "-O3", "-shared", "--compiler-options=-fPIC", "--expt-relaxed-constexpr",
             "-static-global-template-stub=false", f"-arch={arch}", f"-I{src / 'include'}",
             f"-I{src / 'libcudacxx' / 'include'}", f"-DPEER_DTYPE_Q={CUDA_TYPES[query_dtype]}",
             f"-DPEER_DTYPE_KV={CUDA_TYPES[kv_dtype]}", f"-DPEER_HEAD_DIM={HEAD_DIM}"]
    digest = hashlib.sha256(SOURCE.read_bytes() + "\0".join(flags).encode()).hexdigest()[:16]
    library = src / "build" / f"decode-{query_dtype}-{kv_dtype}-{arch}-{digest}.so"
    if library.is_file():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    partial = library.with_suffix(".tmp.so")
    done = subprocess.run(["nvcc", *flags, "-o", str(partial), str(SOURCE)], capture_output=True, text=True,
                          timeout=NVCC_TIMEOUT_S)
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"nvcc failed ({done.returncode}): {' | '.join(tail)}")
    partial.replace(library)
    return library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    fetch_cmd = sub.add_parser("fetch", help="download the headers (needs PyPI)")
    fetch_cmd.add_argument("--dest", type=Path, default=Path(".flashinfer"))
    build_cmd = sub.add_parser("build", help="compile every configuration the bench uses (needs nvcc)")
    build_cmd.add_argument("--src", type=Path, default=Path(".flashinfer"))
    build_cmd.add_argument("--arch", default="sm_90")
    args = parser.parse_args()
    if args.command == "fetch":
        fetch(args.dest)
        print(f"{args.dest}: flashinfer-python {FLASHINFER_VERSION} headers")
        return
    problem = source_problem(args.src)
    if problem:
        sys.exit(f"cannot build: {problem}")
    configs = [(query, kv) for query in ("float16", "bfloat16") for kv in (query, "float8_e4m3fn", "float8_e5m2")]
    # one nvcc per configuration at once: each is single-threaded, and a GPU machine has the cores
    with ThreadPoolExecutor(len(configs)) as pool:
        for library in pool.map(lambda config: build(args.src, *config, args.arch), configs):
            print(library)


if __name__ == "__main__":
    main()
