"""Build the folders of wheels that travel to a lent GPU machine, each small enough for one command's carry.

    python bench/gpu/build_carry.py      # downloads the pins, builds spmdrl's wheel, packs .carry/c1..cN
    python bench/gpu/build_carry.py --resolve --pip-python "$(PYENV_VERSION=3.12.1 pyenv which python3.12)"
                                         # re-resolves the pins (core.txt, vllm.txt, trl.txt) first
    python bench/gpu/build_carry.py --resolve trl --pip-python ...   # trl.txt only: core.txt, vllm.txt held

The GPU machines' image (Python 3.12.3, torch 2.11.0+cu130; image_packages.txt) lacks jsonargparse,
megatron-core and vLLM, and reaches no package index: what spmdrl needs beyond the image travels as
cp312 manylinux x86_64 wheels, at most 64 MiB a command together with the working tree. Chunk c1 is
spmdrl's own wheel and core.txt (jsonargparse with its signature extras and megatron-core 0.19.2): with it
the FSDP2 and Megatron rows run with the native engine. vllm.txt (vLLM 0.26.0, the release that pins torch
2.11.0, and what it needs beyond the image) fills c2..cN; a wheel larger than a chunk is cut into parts that
``matrix.py --install`` joins and checks on the far side. trl.txt (TRL 1.16.0 for the matrix's trl-vllm cell,
and what it needs beyond the image and vllm.txt: datasets, multiprocess, tzdata) fills the room left in
those chunks, before vLLM's ``vllm-later`` wheels. Each chunk folder has ``chunk.json`` (files, sizes,
sha256, each file's kind; the chunk's kind names the kinds it holds, as ``vllm+trl``); the manifest of all
chunks is printed and written to ``.carry/manifest.json``.

``--resolve`` asks pip's resolver (a Python 3.12 pip, ``--dry-run --report``) for the closure of the
requirements, with the image's packages of known version stood in by empty wheels (so torch's CUDA
wheels are never resolved or fetched), drops every package the image has, and writes the pins with their
sha256 (pip's ``--require-hashes`` format). Each pin file is resolved with the requirements of the files
before it, held to their pins (a requirement that would move one is pip's conflict), and holds what they
do not. Not part of the test suite (it needs the package index).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MIB = 1024**2
# What each pin file holds, in order: c1's own requirements, then vLLM's, then TRL's (each resolved with the
# ones before it, so versions agree). TRL 1.16.0's vllm extra asks for vllm>=0.22.0,<=0.31.0.
REQUIREMENTS = {"core": ["jsonargparse[signatures]==4.53.0", "megatron-core==0.19.2"],
                "vllm": ["vllm==0.26.0"], "trl": ["trl==1.16.0"]}
# Image packages that stand in for what the requirements pin, as empty wheels of these versions: the ones
# built against torch's ABI or CUDA (so the resolver never reaches torch's CUDA wheels) and the ones whose
# version vLLM or TRL checks or runs on (accelerate: TRL's trainer). numba: vLLM 0.26.0 pins 0.65.0, which
# wants numpy<2.5; the image's numba imports with its numpy 2.5.2, so it stays. Every other image package is
# resolved like any other and then left out: the image's version is used, and where the resolver chose
# another (numpy: mistral-common caps it below 2.4) the build prints both.
STAND_INS = {"torch": "2.11.0", "torchaudio": "2.11.0", "torchvision": "0.26.0", "triton": "3.6.0",
             "transformers": "5.17.0", "tokenizers": "0.23.2", "safetensors": "0.8.0",
             "huggingface-hub": "1.33.0", "numba": "0.65.0", "accelerate": "1.15.0"}
# vLLM's requirements that its offline generate of a dense bf16 model (the matrix's use) does not import, read
# from vLLM 0.26.0's source: CuTe DSL kernels (MoE routers, Mamba, sparse attention; vLLM checks they import),
# humming-kernels' CUDA compiler, tilelang kernels, video decoding, MLA attention. They fill the last chunks
# (vllm-later), so the vLLM cells can run on the chunks before them; carry these too if a run asks for one.
LATER = {"nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
         "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13", "nvidia-cuda-nvcc", "nvidia-nvvm",
         "nvidia-cuda-crt", "nvidia-cuda-cccl", "nvidia-cuda-nvdisasm", "tilelang", "z3-solver",
         "pynvvideocodec", "torchcodec", "tokenspeed-mla", "tokenspeed-triton"}
# The GPU image: CPython 3.12 on glibc 2.35 (Ubuntu 22.04's manylinux tags and older), x86_64.
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
            *[a for n in ("2_35", "2_34", "2_31", "2_28", "2_27", "2_24", "2_17", "2_12", "2_5")
              for a in ("--platform", f"manylinux_{n}_x86_64")],
            "--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64",
            "--platform", "linux_x86_64"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> dict[str, str | None]:
    """Canonical name -> version (None where unknown) of every package the GPU image has."""
    out: dict[str, str | None] = {}
    for line in (HERE / "image_packages.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.strip().partition("==")
            out[canonical(name)] = version or None
    return out


def _stand_in_wheel(folder: Path, name: str, version: str) -> None:
    """An empty wheel ``name==version+image`` without requirements: the resolver takes the image's package
    as installed instead of resolving (and fetching metadata of) its own requirements."""
    dist = f"{name.replace('-', '_')}-{version}+image"
    files = {f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}+image\n",
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: spmdrl\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n"}
    digest = {p: base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b"=").decode()
              for p, t in files.items()}
    record = "".join(f"{p},sha256={digest[p]},{len(t.encode())}\n" for p, t in files.items())
    record += f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as z:
        for p, t in {**files, f"{dist}.dist-info/RECORD": record}.items():
            z.writestr(p, t)


def resolve_pins(pip_python: str, requirements: list[str], tmp: Path,
                 held: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """Canonical name -> (version, sha256) of the closure of ``requirements`` beyond the image, with the
    packages of ``held`` kept at its versions."""
    image = image_packages()
    fake = tmp / "image"
    fake.mkdir(exist_ok=True)
    for name, version in STAND_INS.items():
        _stand_in_wheel(fake, name, version)
    (tmp / "image.txt").write_text("".join(f"{n}=={v}+image\n" for n, v in STAND_INS.items())
                                   + "".join(f"{n}=={v}\n" for n, (v, _) in held.items()))
    report = tmp / "report.json"
    cmd = [pip_python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--report", str(report),
           "--target", str(tmp / "target"), "--find-links", str(fake), "-c", str(tmp / "image.txt"),
           *PLATFORM, *requirements]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:  # pip's own account of the conflict, without its download noise
        lines = (done.stdout + done.stderr).splitlines()
        start = next((i for i, line in enumerate(lines) if "conflict is caused" in line), len(lines) - 20)
        raise SystemExit(f"pip could not resolve {' '.join(requirements)}:\n" + "\n".join(lines[start:]))
    pins = {}
    for item in json.loads(report.read_text())["install"]:
        name, version = canonical(item["metadata"]["name"]), item["metadata"]["version"]
        if image.get(name) and name not in STAND_INS and image[name] != version:
            print(f"  {name}: the resolver chose {version}; the image's {image[name]} is used")
        if name not in image:
            pins[name] = (version, item["download_info"]["archive_info"]["hashes"]["sha256"])
    return pins


def read_pins(part: str) -> dict[str, tuple[str, str]]:
    """Canonical name -> (version, sha256) of ``{part}.txt``."""
    pins = {}
    for line in (HERE / f"{part}.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            pin, digest = line.split(" --hash=sha256:")
            name, version = pin.split("==")
            pins[canonical(name)] = (version, digest.strip())
    return pins


def write_pins(pip_python: str, start: str) -> None:
    """The pin files from ``start`` on, in REQUIREMENTS' order, from the index: each the closure of its
    requirements and those of the files before it (held to their pins) less their pins."""
    earlier: dict[str, tuple[str, str]] = {}
    requirements: list[str] = []
    for i, (part, wanted) in enumerate(REQUIREMENTS.items()):
        requirements += wanted
        if i < list(REQUIREMENTS).index(start):
            earlier.update(read_pins(part))
            continue
        with tempfile.TemporaryDirectory() as tmp:
            closure = resolve_pins(pip_python, requirements, Path(tmp), earlier)
        pins = {n: p for n, p in closure.items() if n not in earlier}
        before = [f"{e}.txt" for e in list(REQUIREMENTS)[:i]]
        head = f"# {' '.join(wanted)} beyond the GPU image{''.join(f', {b}' for b in before)}; written by " \
               f"build_carry.py --resolve\n"
        lines = [f"{n}=={v} --hash=sha256:{h}\n" for n, (v, h) in sorted(pins.items())]
        (HERE / f"{part}.txt").write_text(head + "".join(lines))
        print(f"{part}.txt: {len(lines)} pins")
        earlier.update(pins)


# Files left out of a wheel after pip checked its hash: what a dense bf16 model's offline generate on a
# Hopper GPU never loads, so that fewer install calls carry it (each costs device time). vLLM 0.26.0: the
# FlashAttention 2 kernels for pre-Hopper GPUs (vllm_flash_attn imports them under try; on SM90 fa_utils
# picks FA3, whose kernels stay) and the Rust API-server front end (vllm/v1/utils.py starts it for
# `vllm serve` only): 138 MiB of the wheel's 290, two chunks.
SLIM = {"vllm": ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs")}


def slim(wheel: Path, drop: tuple[str, ...]) -> None:
    """Rewrite ``wheel`` in place without the files ``drop`` and their RECORD lines."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        missing = [d for d in drop if d not in names]
        if missing:
            raise SystemExit(f"{wheel.name}: SLIM names files it does not hold: {missing}")
        tmp = wheel.with_suffix(".slim")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
            for info in z.infolist():
                if info.filename in drop:
                    continue
                data = z.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    lines = data.decode().splitlines(keepends=True)
                    data = "".join(line for line in lines if line.split(",")[0] not in drop).encode()
                out.writestr(info, data, compress_type=info.compress_type)
    tmp.replace(wheel)


def download(part: str, dest: Path) -> list[Path]:
    """The wheels of ``{part}.txt`` (exact versions, hashes checked by pip) into ``dest``, slimmed by
    ``SLIM``."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--require-hashes",
                    "-d", str(dest), *PLATFORM, "-r", str(HERE / f"{part}.txt")], check=True)
    wanted = {name: version for name, (version, _) in read_pins(part).items()}
    got = [w for w in dest.glob("*.whl")
           if wanted.get(canonical(w.name.split("-")[0])) == w.name.split("-")[1]]
    if len(got) != len(wanted):
        raise SystemExit(f"{dest}: {len(got)} wheels for {len(wanted)} pins of {part}.txt")
    for w in got:
        name = canonical(w.name.split("-")[0])
        if name in SLIM:
            slim(w, SLIM[name])
    return sorted(got)


def spmdrl_wheel(dest: Path) -> Path:
    """spmdrl's own wheel (no requirements are installed with it: the image's torch stays)."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "-w", str(dest), str(REPO)], check=True)
    return next(dest.glob("spmdrl-*.whl"))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def pieces(wheels: list[Path], limit: int, parts_dir: Path) -> list[tuple[Path, dict]]:
    """(file, its chunk.json entry) for each wheel, a wheel over ``limit`` bytes cut into parts of at most
    ``limit`` (entries name the whole wheel, its sha256 and the part count, for the far side to join)."""
    out = []
    for w in wheels:
        size, digest = w.stat().st_size, sha256(w)
        if size <= limit:
            out.append((w, {"file": w.name, "bytes": size, "sha256": digest}))
            continue
        count = -(-size // limit)
        with open(w, "rb") as f:
            for i in range(count):
                part = parts_dir / f"{w.name}.part{i:02d}"
                part.write_bytes(f.read(limit))
                out.append((part, {"file": part.name, "bytes": part.stat().st_size, "sha256": sha256(part),
                                   "part_of": w.name, "part": i, "parts": count, "whole_sha256": digest}))
    return out


def pack(items: list[tuple[Path, dict]], limit: int, chunks: list[list[tuple[Path, dict]]]
         ) -> list[list[tuple[Path, dict]]]:
    """First-fit decreasing into ``chunks`` (filled in place) and new ones after them: as few chunks of at
    most ``limit`` bytes as the items allow."""
    chunks = list(chunks)
    for item in sorted(items, key=lambda it: -it[1]["bytes"]):
        home = next((c for c in chunks if sum(e["bytes"] for _, e in c) + item[1]["bytes"] <= limit), None)
        if home is None:
            chunks.append(home := [])
        home.append(item)
    return chunks


def build(out: Path, limit_mib: float, with_vllm: bool) -> list[dict]:
    """Chunk c1 (spmdrl, core.txt), then vllm.txt's and trl.txt's wheels, vLLM's LATER ones last, into
    ``out``; the manifest. Each file's entry names its kind, and a chunk's kind the kinds it holds."""
    limit = int(limit_mib * MIB)
    if out.exists():
        shutil.rmtree(out)
    work = out / "_download"
    core = [spmdrl_wheel(work / "core"), *download("core", work / "core")]
    chunks = [[(w, {"file": w.name, "bytes": w.stat().st_size, "sha256": sha256(w), "kind": "core"})
               for w in core]]
    if sum(e["bytes"] for _, e in chunks[0]) > limit:
        raise SystemExit(f"chunk c1 (spmdrl + core.txt) is over {limit_mib} MiB")
    if with_vllm:
        (work / "parts").mkdir(parents=True)
        wheels = download("vllm", work / "vllm")
        later = [w for w in wheels if canonical(w.name.split("-")[0]) in LATER]
        kinds = [("vllm", [w for w in wheels if w not in later]), ("trl", download("trl", work / "trl")),
                 ("vllm-later", later)]
        for kind, mine in kinds:
            items = pieces(mine, limit, work / "parts")
            for _, entry in items:
                entry["kind"] = kind
            # Each kind fills the room the chunks before it left (each command carries what it may), but
            # vllm-later: its chunks come last, so that the cells run without them.
            chunks = pack(items, limit, chunks) if kind != "vllm-later" else chunks + pack(items, limit, [])
    manifest = write_chunks(out, chunks, ["+".join(dict.fromkeys(e["kind"] for _, e in c)) for c in chunks])
    shutil.rmtree(work)
    return manifest


def write_chunks(out: Path, chunks: list[list[tuple[Path, dict]]], kinds: list[str]) -> list[dict]:
    """Move each chunk's files into ``out/c1``, ``out/c2``, ... with its ``chunk.json``; write and return the
    manifest."""
    manifest = []
    for i, (chunk, kind) in enumerate(zip(chunks, kinds), 1):
        folder = out / f"c{i}"
        folder.mkdir(parents=True)
        for path, _ in chunk:
            shutil.move(str(path), folder / path.name)
        entries = [e for _, e in chunk]
        spec = {"chunk": i, "kind": kind, "files": entries}
        (folder / "chunk.json").write_text(json.dumps(spec, indent=1) + "\n")
        manifest.append({"chunk": f"c{i}", "kind": kind, "bytes": sum(e["bytes"] for e in entries),
                         "files": entries})
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / ".carry", help="folder of the chunks (replaced)")
    p.add_argument("--limit-mib", type=float, default=60,
                   help="most bytes of one chunk: 64 MiB a command, less the working tree (~2 MiB) that "
                        "travels too")
    p.add_argument("--no-vllm", action="store_true", help="chunk c1 only (no vLLM, no TRL)")
    p.add_argument("--resolve", nargs="?", const="core", choices=list(REQUIREMENTS),
                   help="re-resolve the pin files from this one on (all: core) from the index first")
    p.add_argument("--pip-python", default="python3.12", help="a Python 3.12 with pip, for --resolve")
    a = p.parse_args()
    if a.resolve:
        write_pins(a.pip_python, a.resolve)
    manifest = build(a.out, a.limit_mib, not a.no_vllm)
    for c in manifest:
        print(f"{c['chunk']} ({c['kind']}): {c['bytes'] / MIB:6.1f} MiB, {len(c['files'])} files")
        for e in c["files"]:
            print(f"    {e['file']:<72} {e['bytes'] / MIB:7.2f} MiB  sha256 {e['sha256']}")
    print(f"{len(manifest)} chunks, {sum(c['bytes'] for c in manifest) / MIB:.1f} MiB in all -> {a.out}")


if __name__ == "__main__":
    main()
