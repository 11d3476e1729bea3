"""Where a run's log lines go: the console (progress, one line per failure), the run's log file (everything,
tracebacks included) and the Prefect flow run's log page.

Our loggers (``rlhf_core``, ``tasks``, ``flows``) log at INFO; libraries keep WARNING. Library progress bars are
off: our own progress lines carry rate and ETA, and a worker's output should not fill with weight-loading bars.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PROJECT_LOGGERS = ("rlhf_core", "tasks", "flows")
#: Prefect's reports of task and flow runs (a failure's with a full traceback): the run's log file and Prefect's
#: UI keep them, the console of a CLI run gets one line instead (flows/commands.py).
_FAILURE_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
FORMAT = "%(asctime)s %(name)s: %(message)s"

log = logging.getLogger(__name__)


def quiet_libraries() -> None:
    """Library progress bars and chatter off (in this process and the workers it starts)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # "Creating initial MLflow database tables..."
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    for name in PROJECT_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
    if "mlflow" in sys.modules:  # configured at its import from the variable above; here when imported earlier
        logging.getLogger("mlflow").setLevel(os.environ["MLFLOW_LOGGING_LEVEL"])


def console_logging() -> None:
    """The CLI's console: our lines with their time and logger; Prefect's failure reports (each with a full
    traceback) stay out of it, the CLI prints one line instead (they still reach the run's log file and Prefect).
    Python warnings become log records: those raised from the project's code show, a library's go to the run's
    log file only (nothing a user of the CLI can act on), as does DeepSpeed's accelerator note (below)."""
    logging.basicConfig(level=logging.WARNING, format=FORMAT, datefmt="%H:%M:%S")
    for name in _FAILURE_LOGGERS:
        logging.getLogger(name).propagate = False
    logging.captureWarnings(True)
    for handler in logging.getLogger().handlers:  # basicConfig's (a test harness's own handlers keep everything)
        if type(handler) is logging.StreamHandler and not any(isinstance(f, _ConsoleLines) for f in handler.filters):
            handler.addFilter(_ConsoleLines())
    deepspeed = logging.getLogger("DeepSpeed")  # created here first: DeepSpeed adds its own stdout handler later
    if not any(isinstance(f, _DeepSpeedNotes) for f in deepspeed.filters):
        deepspeed.addFilter(_DeepSpeedNotes())
    quiet_libraries()


#: Where the project's code lives: a Python warning raised from a file under these is the project's own.
_PROJECT_DIRS = tuple(str(Path(__file__).resolve().parents[1] / name) + os.sep for name in PROJECT_LOGGERS)
_FILE_ONLY = "rlhf_file_only"


class _ConsoleLines(logging.Filter):
    """The console's share of the root logger's records: not a library's Python warning, nor a record marked for
    the run's log file only."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, _FILE_ONLY, False):
            return False
        if record.name == "py.warnings":
            return str(record.args[0] if record.args else record.msg).startswith(_PROJECT_DIRS)
        return True


class _DeepSpeedNotes(logging.Filter):
    """DeepSpeed prints to stdout, through its own handler, which accelerator it found, and its CPU fallback as a
    warning: on every machine without a GPU, whether or not a stage uses DeepSpeed (transformers imports it to
    unwrap a model it saves). That note goes to the run's log file; DeepSpeed's other lines stay as they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("Setting accelerator to CPU"):
            return True
        setattr(record, _FILE_ONLY, True)
        logging.getLogger().handle(record)  # the root's handlers: the run's log file, not the console (_ConsoleLines)
        return False


#: Threads inside a :func:`run_logging` block (a run, or a sweep), each with how many blocks it is in.
_LOGGING_THREADS: dict[int, int] = {}
_LOGGING_LOCK = threading.Lock()


class _OwnLines(logging.Filter):
    """Lines of the thread that opened the block, and of threads that are in no other block (background threads):
    runs of a sweep that execute side by side in one process keep their own log files."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread == self.thread or record.thread not in _LOGGING_THREADS


@contextmanager
def run_logging(log_file: Path) -> Iterator[None]:
    """While a run executes: every log line (ours at INFO, libraries' warnings, Prefect's failure reports) is
    appended to ``log_file``, and ours also go to the Prefect flow run's log page. A failure's traceback is
    written to the file once, here. Lines another thread logs inside its own block go to that block's file only."""
    quiet_libraries()
    log_file.parent.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(log_file, encoding="utf-8")
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    to_file.setLevel(logging.INFO)
    to_file.addFilter(_OwnLines())
    thread = threading.get_ident()
    with _LOGGING_LOCK:
        _LOGGING_THREADS[thread] = _LOGGING_THREADS.get(thread, 0) + 1
    # the root logger gets every line; Prefect's run loggers may not propagate there (the CLI's console_logging)
    holders = [logging.getLogger(), *(logger for logger in map(logging.getLogger, _FAILURE_LOGGERS)
                                      if not logger.propagate)]
    for holder in holders:
        holder.addHandler(to_file)
    to_prefect = _prefect_handler()
    project = [logging.getLogger(name) for name in PROJECT_LOGGERS]
    if to_prefect is not None:
        for logger in project:
            logger.addHandler(to_prefect)
    try:
        yield
    except BaseException:
        # the file only: the console gets one line from the CLI, Prefect has the task's own report
        to_file.handle(log.makeRecord(log.name, logging.ERROR, __file__, 0, "the run stopped", (), sys.exc_info()))
        raise
    finally:
        if to_prefect is not None:
            for logger in project:
                logger.removeHandler(to_prefect)
        for holder in holders:
            holder.removeHandler(to_file)
        to_file.close()
        with _LOGGING_LOCK:
            _LOGGING_THREADS[thread] -= 1
            if not _LOGGING_THREADS[thread]:
                del _LOGGING_THREADS[thread]


def _prefect_handler() -> logging.Handler | None:
    """Prefect's API log handler, unless PREFECT_LOGGING_EXTRA_LOGGERS attaches one to our loggers already."""
    from prefect.logging.handlers import APILogHandler

    if any(isinstance(h, APILogHandler) for name in PROJECT_LOGGERS for h in logging.getLogger(name).handlers):
        return None
    return APILogHandler()
