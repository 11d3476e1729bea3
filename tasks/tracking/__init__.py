"""The MLflow adapter: the only package that imports mlflow.

One parent run per pipeline run (tag ``rlhf.run_id``), one nested run per stage, models registered with lineage
tags and aliases. Call :func:`configure_tracking` once per process first. Without MLFLOW_TRACKING_URI tracking goes
to SQLite inside the state folder (artifacts beside it); pointing the variable at a server changes nothing else.
Helpers take explicit MLflow run ids: MLflow's active run is thread-local and Prefect runs tasks in worker threads.

- :mod:`.setup`: the tracking URI, the local store (created under the state folder's init lock, rebased when the
  folder moves), experiments;
- :mod:`.runs`: parent and stage runs, params, metrics, files, live curves (:class:`StageTracker`) and their replay;
- :mod:`.registry`: idempotent registration with lineage tags, aliases, ``models:/`` URIs;
- :mod:`.pyfunc`: the loader MLflow imports for ``mlflow.pyfunc.load_model`` / ``mlflow models serve`` (never
  imported by the pipeline).
"""

from tasks.tracking.registry import (ArtifactReference, ModelRef, get_alias_version, is_transient_error, model_identity, parse_model_uri,
                                     register_model, resolve_model_uri, set_alias, tag_model_version)
from tasks.tracking.runs import (KIND_TAG, PARENT_TAG, RUN_ID_TAG, STAGE_TAG, SWEEP_TAG, StageTracker, end_run,
                                 log_figure, log_file, log_metrics, log_params_flat, log_tables, logged_keys, pipeline_run,
                                 replay_metrics, run_url, set_description, set_run_name, set_tags, stage_run, sweep_run)
from tasks.tracking.runs import MetricSender
from tasks.tracking.setup import (TrackingUnavailable, check_server, configure_tracking, ensure_experiment,
                                  keep_credentials_out, rebase_local_store, without_credentials)

__all__ = ["ArtifactReference", "KIND_TAG", "PARENT_TAG", "RUN_ID_TAG", "STAGE_TAG", "SWEEP_TAG", "ModelRef",
           "StageTracker", "configure_tracking", "end_run", "sweep_run",
           "ensure_experiment", "get_alias_version", "is_transient_error", "log_figure", "log_file", "log_metrics",
           "log_params_flat", "logged_keys", "model_identity", "parse_model_uri", "pipeline_run", "rebase_local_store",
           "register_model", "replay_metrics", "resolve_model_uri", "set_alias", "set_description", "set_run_name",
           "set_tags", "stage_run", "tag_model_version", "log_tables", "run_url", "keep_credentials_out",
           "without_credentials", "check_server", "MetricSender", "TrackingUnavailable"]
