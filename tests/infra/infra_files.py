"""The files under infra/ (and the root .dockerignore) as data, for the infra tests: YAML as loaded, compose's
``${VAR:-default}`` resolved to its default, Dockerfiles as a list of instructions, .dockerignore as a matcher."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
COMPOSE_FILE = INFRA / "docker-compose.yml"
PREFECT_FILE = INFRA / "prefect.yaml"
DOCKERIGNORE = ROOT / ".dockerignore"

_VARIABLE = re.compile(r"\$\{(?P<name>\w+)(?P<default>:?-[^}]*)?\}|\$(?P<bare>[A-Za-z_]\w*)")


def with_defaults(value: Any) -> Any:
    """``value`` (a compose document or part of one) as compose reads it with no variable set: ``${VAR:-x}``
    becomes ``x``. A variable without a default fails: the stack must start without a .env file."""
    if isinstance(value, dict):
        return {key: with_defaults(item) for key, item in value.items()}
    if isinstance(value, list):
        return [with_defaults(item) for item in value]
    if not isinstance(value, str):
        return value

    def default(match: re.Match[str]) -> str:
        if match["default"] is None:
            raise AssertionError(f"{match[0]} in {COMPOSE_FILE.name} has no default; write ${{NAME:-default}}")
        return match["default"].split("-", 1)[1]

    return _VARIABLE.sub(default, value)


def compose() -> dict[str, Any]:
    """infra/docker-compose.yml with its variables at their defaults."""
    return with_defaults(yaml.safe_load(COMPOSE_FILE.read_text()))


def deployments() -> dict[str, dict[str, Any]]:
    """infra/prefect.yaml's deployments by name (YAML anchors and merge keys expanded)."""
    spec = yaml.safe_load(PREFECT_FILE.read_text())
    return {deployment["name"]: deployment for deployment in spec["deployments"]}


def pull_directory(deployment: dict[str, Any]) -> str:
    """The directory of the deployment's one pull step, ``set_working_directory``."""
    (step,) = deployment["pull"]
    (function, arguments), = step.items()
    assert function == "prefect.deployments.steps.set_working_directory", step
    return arguments["directory"]


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction, continuation lines joined."""

    keyword: str
    arguments: str


def dockerfile(path: Path) -> list[Instruction]:
    """The instructions of a Dockerfile, without comments."""
    instructions, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, arguments = pending.strip().partition(" ")
        instructions.append(Instruction(keyword.upper(), " ".join(arguments.split())))
        pending = ""
    return instructions


def arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    """``ARG NAME=default`` of a Dockerfile, by name."""
    arguments = [item.arguments for item in instructions if item.keyword == "ARG" and "=" in item.arguments]
    return dict(argument.split("=", 1) for argument in arguments)


def workdir(instructions: list[Instruction]) -> str:
    """The last WORKDIR: where COPY . . puts the context and where commands run."""
    return [item.arguments for item in instructions if item.keyword == "WORKDIR"][-1]


def copy_sources(instruction: Instruction) -> list[str]:
    """The context paths a COPY/ADD reads (none for ``--from=``, which reads another image)."""
    if instruction.arguments.startswith("["):
        words = json.loads(instruction.arguments)
    else:
        words = shlex.split(instruction.arguments)
    if any(word.startswith("--from=") for word in words):
        return []
    return [word for word in words if not word.startswith("--")][:-1]


def dockerignore_patterns() -> list[str]:
    """The patterns of the root .dockerignore, in order."""
    lines = (line.strip() for line in DOCKERIGNORE.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def dockerignored(relative: str, patterns: list[str]) -> bool:
    """Whether Docker leaves ``relative`` (a path in the build context) out: the last pattern that matches the
    path or one of its parent folders decides (``!`` re-includes); ``**`` spans folders, ``*`` does not."""
    parts = relative.strip("/").split("/")
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        regex = _pattern_regex(pattern.lstrip("!").strip("/"))
        if any(regex.fullmatch("/".join(parts[:end])) for end in range(1, len(parts) + 1)):
            excluded = not negated
    return excluded


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    escaped = re.escape(pattern)
    escaped = escaped.replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*")
    return re.compile(escaped.replace(r"\*", "[^/]*").replace(r"\?", "[^/]"))
