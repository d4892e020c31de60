"""Check that a folder of wheels, with what the GPU image already holds, meets every wheel's requirements.

The GPU machine has no network, so a wheel whose dependency is neither carried nor installed there fails only
at import time, mid-call. This reads each wheel's METADATA (Requires-Dist, markers evaluated for CPython 3.12 on
Linux x86_64, extras skipped) and names what is missing, and any package carried twice (two versions stop the
whole `pip install --no-deps`). The image's packages are KINDS.md's list (names only; its versions are unknown,
so a carried package shadows the image's).
    python bench/tts_bench/check_wheels.py .benchwhl
    python bench/tts_bench/check_wheels.py .nariwhl --unused gradio --unused cuda-python --unused cuda-tile \
        --unused nccl4py --unused nvidia-cudnn-frontend --unused nvidia-cutlass-dsl
"""

from __future__ import annotations

import argparse
import re
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

KINDS = Path("/work/.library/device/KINDS.md")
ENV = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
       "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
       "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def image_packages(path: Path = KINDS) -> set[str]:
    """Names from KINDS.md's 'Python packages already there' paragraph."""
    text = path.read_text()
    block = text.split("Packages: ", 1)[1].split("\n", 1)[0]
    return {canonicalize_name(name.strip(" .")) for name in block.split(",")}


def requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        lines = archive.read(meta).decode().splitlines()
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(ENV)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--also", type=Path, action="append", default=[], help="folders carried beside it")
    parser.add_argument("--unused", action="append", default=[],
                        help="a requirement known not to be imported on the paths run (listed, not counted)")
    args = parser.parse_args()
    wheels = sorted(args.folder.glob("*.whl"))
    carried: dict[str, str] = {}
    problems = 0
    for wheel in wheels + [w for f in args.also for w in sorted(f.glob("*.whl"))]:
        name, version, _, _ = parse_wheel_filename(wheel.name)
        if name in carried:
            print(f"TWICE {name}: {carried[name]} and {version}")
            problems += 1
        carried[name] = str(version)
    image = image_packages()
    unused = {canonicalize_name(n) for n in args.unused}
    for wheel in wheels:
        for req in requirements(wheel):
            name = canonicalize_name(req.name)
            if name in carried:
                if carried[name] not in req.specifier:
                    print(f"CONFLICT {wheel.name}: needs {req}, carried {carried[name]}")
                    problems += 1
            elif name in unused:
                print(f"unused  {wheel.name.split('-')[0]}: {req} (not carried: not imported on the paths run)")
            elif name not in image:
                print(f"MISSING {wheel.name}: needs {req}")
                problems += 1
            else:
                print(f"image   {wheel.name.split('-')[0]}: {req} (version there unknown)")
    print(f"{len(wheels)} wheels, {sum(w.stat().st_size for w in wheels) / 2**20:.1f} MiB, {problems} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
