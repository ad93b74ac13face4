"""The wheels the suite needs on a GPU machine without network access, in pieces that fit what one transfer carries.

``fetch`` (run by ``prepare_wheels.sh`` on a machine with network access) downloads, for the GPU machine's Python and
CUDA major version, bitsandbytes and flash-attn-4 with what flash-attn-4 adds to a CUDA PyTorch install (read from each
wheel's own ``Requires-Dist``, the CUDA extra of that major version selected, what the PyTorch install already has
left out); cuts bitsandbytes' wheel down to the libraries of that CUDA version (its wheel carries every CUDA and ROCm
build: 43 MB, about 4 MB with one); splits every wheel over ``--piece-mib`` into numbered pieces with a manifest
(``<wheel>.parts.json``: the pieces and the whole wheel's sha256); and says what it fetched, how large, and which
transfer each file goes in.

``install`` (run by ``gpu_setup.sh`` on the GPU machine) joins the wheels whose pieces are all present and check out,
installs every complete wheel with ``pip install --no-index --no-deps``, imports each package in a fresh interpreter
(and runs one tiny flash-attn-4 kernel where CUDA is present), and only then says which rows of the suite that
enables; a wheel still missing pieces is left out with a message, and the rows that need it say so when they run.

    python benchmarks/_wheels.py fetch benchmarks/wheels --python 3.12 --cuda 13
    python benchmarks/_wheels.py install benchmarks/wheels/*
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

MIB = 1 << 20
#: what one folder holds: one transfer to the GPU machine carries 64 MiB, with room left for the checkout's own files
TRANSFER_MIB = 60
#: the packages a CUDA PyTorch install already has (never fetched)
PROVIDED = re.compile(
    r"^(torch|triton|numpy|typing[-_]extensions|sympy|networkx|jinja2|fsspec|filelock|setuptools|"
    r"nvidia-(?!cutlass).*)$",
    re.IGNORECASE,
)
#: the suite's rows each optional package enables, and the code that proves it installed: an import, and for
#: flash-attn-4 one tiny kernel where CUDA is present
ENABLES = {
    "bitsandbytes": ("import bitsandbytes", "optimizers: the AdamW8bit and PagedAdamW8bit rows"),
    "flash-attn-4": (
        "import flash_attn.cute as fa, torch\n"
        "if torch.cuda.is_available():\n"
        "    q = torch.randn(1, 128, 2, 64, device='cuda', dtype=torch.bfloat16)\n"
        "    fa.flash_attn_func(q, q, q, causal=True)\n"
        "    torch.cuda.synchronize()",
        'attention: the flash-attn row (`AttentionSwap("flash")` on Hopper)',
    ),
}


def check(package: str) -> str | None:
    """Run ``package``'s check of :data:`ENABLES` in a fresh interpreter: ``None`` when it passes, else why not."""
    done = subprocess.run([sys.executable, "-c", ENABLES[package][0]], capture_output=True, text=True)
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit code {done.returncode}"


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _metadata(wheel: Path) -> dict[str, list[str]]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        message = Parser().parsestr(archive.read(name).decode())
    return {"Name": [str(message["Name"])], "Requires-Dist": message.get_all("Requires-Dist") or []}


def _download(requirement: str, dest: Path, python: str) -> Path:
    """One wheel for Linux x86-64 and ``python``, without its dependencies; returns its path."""
    before = set(dest.glob("*.whl"))
    platforms = ["manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python,
        "--dest",
        str(dest),
        requirement,
    ]
    for platform in platforms:
        command[-1:-1] = ["--platform", platform]
    subprocess.run(command, check=True)
    new = set(dest.glob("*.whl")) - before
    name = _normalise(re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0])
    found = [w for w in new | before if _normalise(w.name.split("-")[0]) == name]
    if not found:
        raise RuntimeError(f"pip downloaded no wheel for {requirement!r}")
    return max(found, key=lambda w: w.stat().st_mtime)


def resolve(roots: list[str], dest: Path, *, python: str, cuda: str) -> list[Path]:
    """Download ``roots`` and, from each wheel's ``Requires-Dist`` (markers read for Linux x86-64 and ``python``, the
    ``cu<major>`` extra chosen), what they need that a CUDA PyTorch install does not have. The CUDA libraries of
    another major version are left out (installed with ``--no-deps``, nothing asks for them); every other requirement
    is fetched (``nvidia-cutlass-dsl-libs-core``, which holds the ``cutlass`` Python package, included)."""
    from packaging.requirements import Requirement

    major = cuda.split(".")[0]
    environment = {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
    }
    queue = [Requirement(r) for r in roots]
    seen: set[str] = set()
    wheels = []
    while queue:
        requirement = queue.pop(0)
        name = _normalise(requirement.name)
        other_cuda = re.fullmatch(r"nvidia-cutlass-dsl-libs-(qnx-)?cu(\d+)", name)
        if name in seen or PROVIDED.match(name) or (other_cuda and other_cuda[2] != major):
            continue
        seen.add(name)
        extras = set(requirement.extras) | {f"cu{major}"}
        wheel = _download(f"{requirement.name}{requirement.specifier}", dest, python)
        wheels.append(wheel)
        for line in _metadata(wheel)["Requires-Dist"]:
            needed = Requirement(line)
            if needed.marker is None or any(needed.marker.evaluate({**environment, "extra": e}) for e in extras | {""}):
                queue.append(needed)
    return wheels


def cut_cuda_libraries(wheel: Path, cuda: str) -> Path:
    """Rewrite bitsandbytes' wheel with only the CPU library and the CUDA ones of ``cuda`` (``"13"``: every 13.x
    build; ``"13.0"``: that one), its ``RECORD`` rewritten to match; returns the new wheel (the old one removed)."""
    wanted = re.compile(
        r"libbitsandbytes_cuda" + re.escape(cuda.replace(".", "")) + (r"\d*" if "." not in cuda else "")
    )
    dropped = re.compile(r"libbitsandbytes_(cuda|rocm|xpu|mps)\w*\.(so|dll|dylib)$")
    out = wheel.with_name(wheel.name + ".cut")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as target:
        kept = [i for i in source.infolist() if not dropped.search(i.filename) or wanted.search(i.filename)]
        if not any(wanted.search(i.filename) for i in kept):
            raise ValueError(f"{wheel.name} has no CUDA {cuda} library: keeping it whole")
        record = next(i for i in kept if i.filename.endswith(".dist-info/RECORD"))
        lines = []
        for info in kept:
            if info is record:
                continue
            data = source.read(info)
            target.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            lines.append(f"{info.filename},sha256={digest},{len(data)}")
        target.writestr(record, "\n".join([*lines, f"{record.filename},,"]) + "\n")
    wheel.unlink()
    return out.rename(wheel)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def split(wheel: Path, piece_mib: int) -> list[Path]:
    """Cut ``wheel`` into ``<wheel>.part.NN`` pieces of at most ``piece_mib`` MiB and a manifest; remove it."""
    pieces = []
    with wheel.open("rb") as file:
        for index, block in enumerate(iter(lambda: file.read(piece_mib * MIB), b"")):
            piece = wheel.with_name(f"{wheel.name}.part.{index:02d}")
            piece.write_bytes(block)
            pieces.append(piece)
    manifest = {"wheel": wheel.name, "sha256": _sha256(wheel), "pieces": [p.name for p in pieces]}
    wheel.with_name(wheel.name + ".parts.json").write_text(json.dumps(manifest, indent=1) + "\n")
    wheel.unlink()
    return pieces


def join(files: dict[str, Path], into: Path) -> tuple[list[Path], list[str]]:
    """Join every split wheel among ``files`` (name -> path, from any number of folders) whose pieces are all there
    and whose sha256 matches, into ``into``; returns the joined wheels and, for each wheel left out, why."""
    joined, missing = [], []
    for name in sorted(n for n in files if n.endswith(".parts.json")):
        manifest = json.loads(files[name].read_text())
        absent = [p for p in manifest["pieces"] if p not in files]
        if absent:
            missing.append(f"{manifest['wheel']}: {len(absent)} of {len(manifest['pieces'])} pieces absent")
            continue
        wheel = into / manifest["wheel"]
        with wheel.open("wb") as out:
            for piece in manifest["pieces"]:
                out.write(files[piece].read_bytes())
        if _sha256(wheel) != manifest["sha256"]:
            wheel.unlink()
            missing.append(f"{manifest['wheel']}: the joined pieces do not match its sha256")
            continue
        joined.append(wheel)
    return joined, missing


def transfers(files: list[Path], limit_mib: int = TRANSFER_MIB) -> list[list[Path]]:
    """Group ``files`` into transfers of at most ``limit_mib`` MiB each: bitsandbytes' wheel first (so that the first
    folder alone enables the 8-bit rows), then the rest largest first."""
    groups: list[tuple[int, list[Path]]] = []
    for path in sorted(files, key=lambda p: (not p.name.startswith("bitsandbytes-"), -p.stat().st_size)):
        size = path.stat().st_size
        for index, (used, group) in enumerate(groups):
            if used + size <= limit_mib * MIB:
                groups[index] = (used + size, [*group, path])
                break
        else:
            groups.append((size, [path]))
    return [group for _, group in groups]


def fetch(folder: Path, *, python: str, cuda: str, piece_mib: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    wheels = resolve(["bitsandbytes>=0.50", "flash-attn-4>=4.0.0b0"], folder, python=python, cuda=cuda)
    for wheel in wheels:
        size = wheel.stat().st_size
        if wheel.name.startswith("bitsandbytes-"):
            wheel = cut_cuda_libraries(wheel, cuda)
            cut = wheel.stat().st_size / MIB
            print(f"{wheel.name}: cut to the CUDA {cuda} libraries, {size / MIB:.1f} -> {cut:.1f} MiB")
        else:
            print(f"{wheel.name}: {size / MIB:.1f} MiB")
        if wheel.stat().st_size > piece_mib * MIB:
            pieces = split(wheel, piece_mib)
            print(f"  over {piece_mib} MiB: split into {len(pieces)} pieces and {wheel.name}.parts.json")
    files = [p for p in folder.iterdir() if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    groups = transfers(files)
    print(
        f"{len(files)} files, {total / MIB:.1f} MiB, in {len(groups)} folder(s) of at most {TRANSFER_MIB} MiB each "
        "(one transfer to the GPU machine carries 64 MiB): carry each in its own transfer, then all to gpu_setup.sh:"
    )
    for index, group in enumerate(groups, 1):
        (folder / str(index)).mkdir(exist_ok=True)
        for path in group:
            path.rename(folder / str(index) / path.name)
        size = sum((folder / str(index) / p.name).stat().st_size for p in group)
        print(f"  {folder / str(index)} ({size / MIB:.1f} MiB): {' '.join(p.name for p in group)}")


def install(folders: list[Path]) -> None:
    files = {p.name: p for folder in folders if folder.is_dir() for p in sorted(folder.iterdir()) if p.is_file()}
    with tempfile.TemporaryDirectory() as work:
        joined, missing = join(files, Path(work))
        wheels = [*(p for n, p in sorted(files.items()) if n.endswith(".whl")), *joined]
        for reason in missing:
            print(f"left out: {reason}")
        if wheels:
            subprocess.run(
                [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", *map(str, wheels)],
                check=True,
            )
    for package, (_, rows) in ENABLES.items():
        failure = check(package)
        verdict = f"installed, enables {rows}" if failure is None else f"not usable ({failure}), not measured: {rows}"
        print(f"{package}: {verdict}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    get = commands.add_parser("fetch", help="download, cut and split the wheels (needs network access)")
    get.add_argument("folder", type=Path)
    get.add_argument("--python", required=True, help="the GPU machine's Python, e.g. 3.12")
    get.add_argument("--cuda", required=True, help="its PyTorch's CUDA major version (13) or version (13.0)")
    get.add_argument("--piece-mib", type=int, default=40, help="largest piece a wheel is split into")
    put = commands.add_parser("install", help="join and install what is complete (no network access needed)")
    put.add_argument("folders", type=Path, nargs="+", help="the folders fetch filled (DIR/1 DIR/2 ...)")
    args = parser.parse_args(argv)
    if args.command == "fetch":
        if not re.fullmatch(r"3\.\d+", args.python):
            parser.error(f"`--python` must be a version like 3.12, got {args.python!r}")
        if not re.fullmatch(r"\d+(\.\d)?", args.cuda):
            parser.error(f"`--cuda` must be a CUDA major version like 13 (or 13.0), got {args.cuda!r}")
        fetch(args.folder, python=args.python, cuda=args.cuda, piece_mib=args.piece_mib)
    else:
        install(args.folders)


if __name__ == "__main__":
    main()
