"""The images infra/docker-compose.yml builds: contexts, Dockerfiles and copied paths exist, the build context
leaves the environment, state and history out, and torch comes from an explicitly chosen index."""

from __future__ import annotations

import re
import tomllib

import pytest

from tests.infra.infra_files import (
    INFRA,
    ROOT,
    arg_defaults,
    compose,
    copy_sources,
    dockerfile,
    dockerignore_patterns,
    dockerignored,
    workdir,
)

#: What the worker image's build context must leave out, and what its install needs.
LEFT_OUT = [".venv", ".git", ".rlhf_state", "mlruns", "flows/__pycache__/pipeline.cpython-311.pyc",
            "rlhf_pipeline.egg-info"]
KEPT = ["pyproject.toml", "README.md", "flows/pipeline.py", "tasks/config/__init__.py", "rlhf_core/__init__.py",
        "infra/presets/demo.yaml"]


def builds() -> dict:
    """Each service's build (context resolved against infra/, where the compose file is)."""
    return {name: {**service["build"], "context": (INFRA / service["build"]["context"]).resolve()}
            for name, service in compose()["services"].items() if "build" in service}


def test_the_custom_images_are_the_worker_and_mlflow():
    assert set(builds()) == {"worker", "mlflow"}


@pytest.mark.parametrize("service", ["worker", "mlflow"])
def test_build_context_dockerfile_and_every_copied_path_exist(service):
    build = builds()[service]
    context, path = build["context"], build["context"] / build["dockerfile"]
    assert context.is_dir() and path.is_file(), build
    ignored = dockerignore_patterns() if context == ROOT else []
    instructions = dockerfile(path)
    for item in instructions:
        if item.keyword in {"COPY", "ADD"}:
            for source in copy_sources(item):
                assert (context / source).exists(), f"{path.name}: {item.keyword} {source}: not in the context"
                assert source == "." or not dockerignored(source, ignored), f"{source} is in .dockerignore"
    # A script the image or its compose command starts from the image's own tree must come from the context.
    if any(item.keyword == "WORKDIR" for item in instructions):
        root = workdir(instructions)
        commands = [item.arguments for item in instructions if item.keyword in {"ENTRYPOINT", "CMD"}]
        commands.append(compose()["services"][service].get("command", ""))
        for used in (path for command in commands for path in re.findall(re.escape(root) + r"/[\w./-]+", command)):
            assert (context / used.removeprefix(root + "/")).exists(), f"{service}: {used} is not in the context"


@pytest.mark.parametrize("path", LEFT_OUT)
def test_dockerignore_keeps_environment_state_and_history_out_of_the_image(path):
    assert dockerignored(path, dockerignore_patterns()), path


@pytest.mark.parametrize("path", KEPT)
def test_dockerignore_keeps_what_the_install_needs(path):
    assert (ROOT / path).exists(), path
    assert not dockerignored(path, dockerignore_patterns()), path


def test_dockerignore_matcher_reads_patterns_like_docker():
    patterns = [".venv", "**/__pycache__", "*.egg-info", "docs", "!docs/keep.md"]
    assert dockerignored(".venv/lib/python3.11/site.py", patterns)
    assert dockerignored("tasks/run_store/__pycache__/x.pyc", patterns)
    assert dockerignored("rlhf_pipeline.egg-info/PKG-INFO", patterns)
    assert not dockerignored("tasks/.venv", patterns)  # a pattern without ** anchors at the context root
    assert dockerignored("docs/results.md", patterns)
    assert not dockerignored("docs/keep.md", patterns)


def test_worker_image_installs_the_pinned_torch_from_an_explicit_index():
    instructions = dockerfile(ROOT / builds()["worker"]["dockerfile"])
    default_index = arg_defaults(instructions)["TORCH_INDEX"]
    assert default_index.endswith("/whl/cpu"), "the default image is the CPU one"
    installs = [item.arguments for item in instructions if item.keyword == "RUN" and "pip install" in item.arguments]
    torch_installs = [command for command in installs if "torch" in command]
    assert torch_installs, "no RUN installs torch"
    for command in torch_installs:
        assert '--index-url "$TORCH_INDEX"' in command, command
    # The RUN takes the version from pyproject.toml's `torch==` pin, and compose passes the same default index.
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(dependency.startswith("torch==") for dependency in dependencies)
    assert builds()["worker"]["args"]["TORCH_INDEX"] == default_index


def test_worker_image_is_an_editable_install_of_its_working_directory():
    instructions = dockerfile(ROOT / builds()["worker"]["dockerfile"])
    assert any(item.keyword == "COPY" and item.arguments == ". ." for item in instructions)
    assert any(item.keyword == "RUN" and item.arguments.endswith("pip install --no-deps -e .")
               for item in instructions), "presets are read next to the code: keep the install editable"
