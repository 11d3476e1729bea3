"""The model registry: idempotent, lineage-tagged registration, aliases, and ``models:/`` URIs."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from tasks.run_store import RunStore
from tasks.tracking.setup import configured_store, slug

_MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))$")


@dataclass(frozen=True)
class ModelRef:
    """A registered model version."""

    name: str
    version: int

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"



#: MLflow error codes of a busy store (a locked SQLite file, a rate-limited server); a retry may pass.
#: Not INTERNAL_ERROR: it is the default code of every MlflowException, bugs included.
_TRANSIENT_CODES = frozenset({"TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED"})


def is_transient_error(error: BaseException) -> bool:
    """True for MLflow errors that may pass on a retry (busy store, rate limit)."""
    return isinstance(error, MlflowException) and error.error_code in _TRANSIENT_CODES



def _version_filter(name: str, tags: Mapping[str, str]) -> str:
    return " and ".join([f"name='{name}'", *(f"tags.`{k}`='{v}'" for k, v in sorted(tags.items()))])


#: What each role's model maps (the registry's "Schema"): a policy writes a response to a prompt; a reward model
#: scores a prompt and response. Only metadata: the folders are Hugging Face checkpoints, not pyfunc models.
SIGNATURES = {
    "policy": ({"prompt": "string"}, {"response": "string"}),
    **{role: ({"prompt": "string", "response": "string"}, {"score": "double"})
       for role in ("proxy", "heldout", "reward_model")},
}


PYFUNC_LOADER = "tasks.tracking.pyfunc"
"""The loader module of every registered version's ``python_function`` flavor (imported by MLflow at load time)."""
GENERATION_PARAMS = ("max_new_tokens", "temperature", "top_k", "top_p")
"""The generation settings a policy's pyfunc takes as ``params`` (besides ``seed``)."""
SETTINGS_FILE = "rlhf_pyfunc.json"
"""Beside the ``MLmodel``: what the loader needs, ``{"role": ..., "generation": {...}}`` for a policy."""

REFERENCE_FILE = "rlhf_model.json"
"""What a version registered by reference holds instead of weights: {'artifact': 'stage/key', 'path': folder,
'state_dir': the state folder that holds the artifact}."""


@dataclass(frozen=True)
class ArtifactReference:
    """A model folder inside a run-store artifact: what a version registered by reference points at."""

    artifact: str
    """The artifact's identity, ``stage/key``."""
    path: str
    """The model folder, relative to the artifact."""


def register_model(folder: str | os.PathLike[str], name: str, mlflow_run_id: str, lineage: Mapping[str, str],
                   aliases: Sequence[str] = ("candidate",), description: str = "",
                   reference: ArtifactReference | None = None, usage: Mapping[str, Any] | None = None) -> ModelRef:
    """Register ``folder`` as a version of ``name`` for ``mlflow_run_id``, tagged with ``lineage``.

    Idempotent: a version carrying the same ``rlhf.run_id``, ``rlhf.artifact_key`` and ``rlhf.role`` tags is
    returned instead of registering another (a retried or resumed stage). A version of the same artifact that
    another run registered lends its files (no second upload of the weights). ``aliases`` move to the version.
    The uploaded files get an ``MLmodel`` with the role's signature (:data:`SIGNATURES`), shown by the registry, and
    a ``python_function`` flavor (:data:`PYFUNC_LOADER`; ``usage``: what it needs, a policy's ``generation``
    settings), so ``mlflow.pyfunc.load_model`` and ``mlflow models serve`` work.
    With ``reference`` (``tracking.model_storage=reference``) the weights are not uploaded: the version's files are
    the ``MLmodel`` and :data:`REFERENCE_FILE` (a few hundred bytes), and :func:`resolve_model_uri` loads the
    artifact's folder from the state folder. (MLflow servers refuse a local path as a version's source, so the
    pointer lives in the run's artifacts like any upload.)
    """
    client = MlflowClient()
    try:
        client.create_registered_model(name)
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    identity = {k: lineage[k] for k in ("rlhf.run_id", "rlhf.artifact_key", "rlhf.role") if k in lineage}
    mine = client.search_model_versions(_version_filter(name, identity))
    if mine:
        version = max(int(v.version) for v in mine)
    else:
        same = client.search_model_versions(_version_filter(name, {k: v for k, v in identity.items()
                                                                   if k != "rlhf.run_id"}))

        def create(source: str) -> int:
            return int(client.create_model_version(name, source=source, run_id=mlflow_run_id, tags=dict(lineage),
                                                   description=description or None).version)

        def upload() -> str:
            return _upload(client, Path(folder), name, mlflow_run_id, lineage.get("rlhf.role"), reference, usage)

        try:
            version = create(same[0].source if same else upload())
        except MlflowException as err:
            # A tracking server may refuse a source that lies in another run's artifacts: upload this copy then.
            if not same or err.error_code != "INVALID_PARAMETER_VALUE":
                raise
            version = create(upload())
    for alias in aliases:
        client.set_registered_model_alias(name, alias, str(version))
    return ModelRef(name, version)


def _upload(client: MlflowClient, folder: Path, name: str, run_id: str, role: str | None,
            reference: ArtifactReference | None = None, usage: Mapping[str, Any] | None = None) -> str:
    """Log the model's files (or, with ``reference``, only a pointer to them) under ``models/<name>[-n]`` of the
    run; returns that folder's artifact URI (the version's source)."""
    if not folder.is_dir():
        raise FileNotFoundError(f"cannot register {folder}: not a folder (save the model with save_pretrained first)")
    base = artifact_path = f"models/{slug(name)}"
    n = 1
    while client.list_artifacts(run_id, artifact_path):  # never overwrite an earlier version's files
        n += 1
        artifact_path = f"{base}-{n}"
    with tempfile.TemporaryDirectory() as scratch:
        if reference is None:
            client.log_artifacts(run_id, str(folder), artifact_path)
        else:
            pointer = Path(scratch) / REFERENCE_FILE
            pointer.write_text(json.dumps({"artifact": reference.artifact, "path": reference.path,
                                           "state_dir": str(configured_store().root)}) + "\n")
            client.log_artifact(run_id, str(pointer), artifact_path)
        if role in SIGNATURES:
            _model_file(role, Path(scratch) / "MLmodel", usage)
            client.log_artifact(run_id, str(Path(scratch) / "MLmodel"), artifact_path)
            settings = Path(scratch) / SETTINGS_FILE
            settings.write_text(json.dumps({"role": role, **(usage or {})}, indent=1) + "\n", encoding="utf-8")
            client.log_artifact(run_id, str(settings), artifact_path)
    return f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/{artifact_path}"


def _model_file(role: str, path: Path, usage: Mapping[str, Any] | None = None) -> None:
    """The version's ``MLmodel``: the role's signature (a policy's generation settings as its params, defaulting to
    those it was trained with), and the pyfunc flavor whose loader is :data:`PYFUNC_LOADER` (it reads the version's
    files themselves, ".")."""
    from mlflow.models import Model, ModelSignature
    from mlflow.pyfunc import add_to_model
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    inputs, outputs = SIGNATURES[role]
    generation = (usage or {}).get("generation")
    params = None
    if generation is not None:
        params = ParamSchema([ParamSpec(k, "long" if isinstance(v, int) else "double", v) for k, v in generation.items()
                              if k in GENERATION_PARAMS] + [ParamSpec("seed", "long", 0)])
    signature = ModelSignature(Schema([ColSpec(t, n) for n, t in inputs.items()]),
                               Schema([ColSpec(t, n) for n, t in outputs.items()]), params)
    model = Model(signature=signature, metadata={"rlhf.role": role, "format": "Hugging Face save_pretrained folder"})
    add_to_model(model, loader_module=PYFUNC_LOADER, data=".")
    model.save(path)


def tag_model_version(uri: str, tags: Mapping[str, object]) -> None:
    """Tags on the registered version ``uri`` names (evaluation results, hacking status), shown in the registry."""
    ref = parse_model_uri(uri)
    client = MlflowClient()
    for key, value in tags.items():
        client.set_model_version_tag(ref.name, str(ref.version), key, str(value))


def set_alias(name: str, alias: str, version: int) -> None:
    """Point ``models:/name@alias`` at ``version`` (e.g. promote to 'champion')."""
    MlflowClient().set_registered_model_alias(name, alias, str(version))


def get_alias_version(name: str, alias: str) -> int | None:
    """The version ``alias`` points at, or None when the alias (or the model) does not exist."""
    try:
        return int(MlflowClient().get_model_version_by_alias(name, alias).version)
    except MlflowException as err:
        if err.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def parse_model_uri(uri: str) -> ModelRef:
    """``models:/name/version`` or ``models:/name@alias`` -> the version it names now."""
    match = _MODELS_URI.match(uri)
    if match is None:
        raise ValueError(f"{uri!r} is not a registry URI; use models:/<name>/<version> or models:/<name>@<alias>")
    name = match["name"]
    if match["version"] is not None:
        return ModelRef(name, int(match["version"]))
    version = get_alias_version(name, match["alias"])
    if version is None:
        raise ValueError(f"{uri!r}: registered model {name!r} has no alias {match['alias']!r}")
    return ModelRef(name, version)


def model_identity(uri: str) -> str:
    """What a ``models:/`` URI contributes to an artifact key: the version it resolves to and that version's files."""
    ref = parse_model_uri(uri)
    return f"{ref.uri} {MlflowClient().get_model_version(ref.name, str(ref.version)).source}"


def resolve_model_uri(uri_or_path: str) -> str:
    """A local folder for a model: paths (and Hugging Face ids) come back as they are; ``models:/`` URIs are
    downloaded once into the state folder's model cache and that copy is returned."""
    if not uri_or_path.startswith("models:/"):
        return uri_or_path
    ref = parse_model_uri(uri_or_path)
    source = MlflowClient().get_model_version_download_uri(ref.name, str(ref.version))
    # The source hash keeps a cache from an older (deleted) store from answering for a new version of that number.
    digest = hashlib.sha256(source.encode("utf-8")).hexdigest()[:8]
    target = configured_store().layout.model_cache / slug(ref.name) / f"v{ref.version}-{digest}"
    if target.exists():
        return _referenced(target, uri_or_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".download-", dir=target.parent)
    try:
        downloaded = mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=scratch)
        try:
            os.replace(downloaded, target)
        except OSError:
            if not target.exists():  # else another process finished the same download first
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return _referenced(target, uri_or_path)


def _referenced(folder: Path, uri: str) -> str:
    """``folder`` (a downloaded version), or the state folder's artifact folder its :data:`REFERENCE_FILE` names."""
    return str(referenced_folder(folder, configured_store(), uri))


def referenced_folder(folder: Path, store: RunStore | None = None, uri: str = "this version") -> Path:
    """``folder`` (a downloaded version's files), or, for a version registered by reference, the artifact folder its
    :data:`REFERENCE_FILE` names in ``store`` (default: the state folder the pointer records)."""
    pointer = folder / REFERENCE_FILE
    if not pointer.is_file():
        return folder
    target = json.loads(pointer.read_text(encoding="utf-8"))
    if store is None:
        if "state_dir" not in target:
            raise FileNotFoundError(f"{pointer} names no state folder (registered by an earlier release): load it "
                                    "with resolve_model_uri from the state folder that produced it")
        store = RunStore(target["state_dir"])
    stage, _, key = target["artifact"].partition("/")
    artifact = store.artifact(stage, key)
    if artifact is None:
        raise FileNotFoundError(f"{uri} was registered by reference (tracking.model_storage=reference) to artifact "
                                f"{target['artifact']}, which state folder {store.root} does not hold: run with the "
                                "state dir that produced it (shared storage), or register with model_storage=upload")
    return Path(artifact.path(target["path"]))