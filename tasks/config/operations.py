"""The operational sections of the pipeline config: MLflow names, Prefect's stage timeouts and the DeepSpeed launch.
None of them changes what a stage computes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from rlhf_core.ranges import Positive, PositiveInt, Range, check_ranges
from tasks.run_store.keys import LocalPath


@dataclass(frozen=True)
class TrackingSection:
    """MLflow experiment and registered-model names."""

    experiment: str = "rlhf"
    """MLflow experiment of the pipeline runs."""
    policy_model: str | None = None
    """Registered model name of policy checkpoints; None = '<experiment>-policy', so runs of another experiment
    (a smoke test on the tiny preset) never move this experiment's @champion."""
    reward_model: str | None = None
    """Registered model name of the proxy reward model; None = '<experiment>-reward-model'."""
    heldout_reward_model: str | None = None
    """Registered model name of the held-out reward model; None = '<experiment>-heldout-reward-model'."""
    tracking_uri: str | None = None
    """MLflow tracking URI; None = SQLite in the state dir. The MLFLOW_TRACKING_URI env variable wins."""
    model_storage: Literal["upload", "reference"] = "upload"
    """Where registered model versions keep their weights. 'upload': a copy in MLflow's artifact store (through the
    tracking server; the MLflow UI shows the files). 'reference': no upload, the version holds a small pointer to
    its immutable artifact in the state dir and ``models:/`` URIs load from there; the state dir must then be shared
    storage that every process loading those models sees (a 7B policy is ~15 GB per iteration not sent)."""

    def __post_init__(self) -> None:
        # resolved here, once: the recorded config names the models it registers
        for name, suffix in (("policy_model", "policy"), ("reward_model", "reward-model"),
                             ("heldout_reward_model", "heldout-reward-model")):
            if getattr(self, name) is None:
                object.__setattr__(self, name, f"{self.experiment}-{suffix}")


@dataclass(frozen=True)
class OrchestrationSection:
    """How Prefect runs the stages (none of it enters an artifact key)."""

    stage_timeout_minutes: Positive | None = None
    """A stage (one task run) still running after this many minutes fails with a timeout and the run can be
    resumed (``rlhf resume``); None = no limit. Set it on scheduled runs so a hung stage does not hold the
    deployment's single slot forever."""

    def __post_init__(self) -> None:
        check_ranges(self, "orchestration")


@dataclass(frozen=True)
class DistributedSection:
    """How the reward-model and ppo-iteration stages run their training (docs/scaling.md).

    Without ``deepspeed_config`` they train in the stage's own process (CPU or one GPU). With it, the stage
    writes a job file, starts ``num_processes`` x ``num_nodes`` workers with ``launcher``
    (``python -m tasks.ppo_job --job ...`` or ``tasks.reward_job``), follows their metrics into MLflow and continues with
    the weights they trained: data-parallel DeepSpeed ZeRO, with the same stage code and the same results.
    """

    deepspeed_config: LocalPath | None = None
    """DeepSpeed JSON (e.g. infra/deepspeed/zero2.json, zero3_offload.json); None = train in the stage's process."""
    num_processes: PositiveInt = 1
    """Worker processes per node: one per GPU."""
    num_nodes: PositiveInt = 1
    """Nodes. 'deepspeed' starts every node listed in ``hostfile`` from here (ssh/pdsh); with 'torchrun' this
    node is node 0 and each other node runs the command the stage logs (same job file on shared storage)."""
    launcher: Literal["torchrun", "deepspeed"] = "torchrun"
    """Which launcher starts the workers."""
    hostfile: str | None = None
    """'deepspeed' launcher only: one 'hostname slots=N' line per node; None = this machine."""
    master_addr: str = "127.0.0.1"
    """Address of node 0, where rank 0 listens (another node's workers must reach it)."""
    master_port: Annotated[int, Range(ge=1, le=65535)] | None = None
    """Port of rank 0's rendezvous; None = a free port chosen at each launch (one node: a retry never meets the
    port of workers still closing). Several nodes must name it: every node dials it."""
    stages: tuple[Literal["reward-model", "ppo-iteration"], ...] = ("reward-model", "ppo-iteration")
    """Stages whose training runs this way (the others always run in their own process)."""

    def __post_init__(self) -> None:
        check_ranges(self, "distributed")
        if self.deepspeed_config is None and self.num_processes * self.num_nodes > 1:
            raise ValueError("distributed.num_processes / num_nodes > 1 need distributed.deepspeed_config "
                             "(e.g. infra/deepspeed/zero2.json)")
        if self.hostfile is not None and self.launcher != "deepspeed":
            raise ValueError("distributed.hostfile is read only by distributed.launcher='deepspeed'")
        if self.num_nodes > 1 and self.launcher == "deepspeed" and self.hostfile is None:
            raise ValueError("distributed.num_nodes > 1 with distributed.launcher=deepspeed needs distributed.hostfile "
                             "(one 'hostname slots=N' line per node: the launcher starts each of them over ssh)")
        if self.num_nodes > 1 and self.master_port is None:
            raise ValueError("distributed.num_nodes > 1 needs distributed.master_port (every node dials rank 0 there), "
                             "e.g. distributed.master_port=29500")

    def runs(self, stage: str) -> bool:
        """True when ``stage`` launches its training on DeepSpeed workers."""
        return self.deepspeed_config is not None and stage in self.stages
