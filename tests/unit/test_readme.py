"""The README is a user guide that must stay true: its code imports, its config examples load."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tasks.config import load_config

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def test_ppo_in_a_few_lines_imports_as_written():
    block = README.split("## PPO in a few lines", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    imports = "\n".join(line for line in block.splitlines() if line.startswith(("from ", "import ")))
    assert imports.count("\n") >= 2
    exec(compile(imports, "README.md", "exec"), {})


#: ``rlhf sweep --grid KEY=V1,V2`` examples: each value is an override of its own.
GRIDS = re.findall(r"--grid ((?:[a-z_]+\.)+[a-z_]+)=([^\s`]+)", README)
EXAMPLES = sorted(set(re.findall(r"`((?:[a-z_]+\.)+[a-z_]+=[^`\s]+)`", README)) |
                  {m for m in re.findall(r"(?<=\s)((?:[a-z_]+\.)+[a-z_]+=[^\s`]+)", README) if "/" not in m}
                  - {f"{key}={values}" for key, values in GRIDS}
                  | {f"{key}={value}" for key, values in GRIDS for value in values.split(",")})


#: Settings the README shows next to an example that needs them.
COMPANIONS = {"refresh.labels_file": ["refresh.annotator=file"],
              "distributed.num_processes": ["distributed.deepspeed_config=infra/deepspeed/zero2.json"],
              "ppo.advantage=grpo": ["ppo.samples_per_prompt=4"], "ppo.advantage=rloo": ["ppo.samples_per_prompt=4"],
              "ppo.kl.placement": ["ppo.kl.estimator=k3"]}


@pytest.mark.parametrize("override", EXAMPLES)
def test_every_config_example_in_the_readme_loads(override: str):
    companions = next((c for key, c in COMPANIONS.items() if override == key or override.startswith(key + "=")), [])
    load_config(None, "tiny", [*companions, override])


def test_the_examples_were_found():
    assert {"ppo.kl.coef=0.1", "sft.learning_rate=2e-3", "ppo.iterations=5"} <= set(EXAMPLES)
    assert GRIDS and {"ppo.learning_rate=1e-4", "ppo.learning_rate=3e-4"} <= set(EXAMPLES)
