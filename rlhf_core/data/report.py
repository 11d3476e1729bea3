"""Counts of the data-prep stage: reconciled on construction, printable, and flat for metric logging."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DataPrepCounts:
    """How many rows went where. Construction fails if the numbers do not reconcile."""

    rows_in: int
    """Preference rows read from all input files (malformed records included)."""
    rows_accepted: int
    """Rows that became canonical pairs: train_pairs + heldout_pairs + ppo_split_pairs."""
    rows_quarantined: int
    """Preference rows sent to the quarantine table."""
    train_pairs: int
    """Pairs in the reward-model training table."""
    heldout_pairs: int
    """Pairs in the held-out table."""
    ppo_split_pairs: int
    """Accepted pairs whose prompt fell in the PPO split (their prompts feed PPO; the pairs are not written)."""
    ppo_prompts: int
    """Distinct prompts in the PPO prompts table."""
    quarantined_by_reason: dict[str, int] = field(default_factory=dict)
    """Quarantine reason code -> rows, over preference and prompt rows."""
    prompt_rows_in: int = 0
    """Rows read from the separate prompts file (0 when none is given)."""
    prompt_rows_accepted: int = 0
    """Prompts-file rows kept as PPO prompts."""
    prompt_rows_quarantined: int = 0
    """Prompts-file rows quarantined."""
    formats: dict[str, str] = field(default_factory=dict)
    """Input file -> detected (or forced) format."""
    length_unit: str = "characters"
    """What max_length and too_long lengths count: 'characters', or 'tokens' when a tokenizer was given."""
    max_length: int | None = None
    """The max_length applied (prompt + response, in length_unit); None = no limit."""
    max_prompt_length: int | None = None
    """The max_prompt_length applied (each prompt, in length_unit); None = no limit."""
    max_chars: int | None = None
    """The max_chars cap applied (each text, always in characters); None = no cap."""

    def __post_init__(self) -> None:
        checks = {
            "rows_in == rows_accepted + rows_quarantined": self.rows_in == self.rows_accepted + self.rows_quarantined,
            "rows_accepted == train + heldout + ppo_split pairs": self.rows_accepted
            == self.train_pairs + self.heldout_pairs + self.ppo_split_pairs,
            "prompt_rows_in == accepted + quarantined": self.prompt_rows_in
            == self.prompt_rows_accepted + self.prompt_rows_quarantined,
            "sum(quarantined_by_reason) == quarantined rows": sum(self.quarantined_by_reason.values())
            == self.rows_quarantined + self.prompt_rows_quarantined,
        }
        broken = [name for name, ok in checks.items() if not ok]
        if broken:  # a bug in data prep, never a user error: rows must not vanish
            raise AssertionError(f"data-prep counts do not reconcile ({', '.join(broken)}): {self}")

    @property
    def quarantine_fraction(self) -> float:
        """Quarantined share of all rows read (preference and prompts-file rows)."""
        total = self.rows_in + self.prompt_rows_in
        return (self.rows_quarantined + self.prompt_rows_quarantined) / total if total else 0.0

    def as_metrics(self) -> dict[str, float]:
        """Flat `data/...` metric names -> values, ready for an experiment tracker."""
        metrics = {
            f"data/{name}": float(getattr(self, name))
            for name in ("rows_in", "rows_accepted", "rows_quarantined", "train_pairs", "heldout_pairs",
                         "ppo_split_pairs", "ppo_prompts", "prompt_rows_in", "prompt_rows_accepted",
                         "prompt_rows_quarantined")
        }
        metrics["data/quarantine_fraction"] = self.quarantine_fraction
        metrics.update({f"data/quarantined/{r}": float(n) for r, n in self.quarantined_by_reason.items()})
        return metrics


def format_counts(counts: DataPrepCounts) -> str:
    """A small aligned text table of the counts, for the CLI and task logs."""
    rows: list[tuple[str, object]] = [(f"format  {path}", fmt) for path, fmt in counts.formats.items()]
    rows += [("rows in", counts.rows_in), ("accepted", counts.rows_accepted),
             ("quarantined", counts.rows_quarantined)]
    if counts.prompt_rows_in:
        rows += [("prompt rows in", counts.prompt_rows_in), ("prompts accepted", counts.prompt_rows_accepted),
                 ("prompts quarantined", counts.prompt_rows_quarantined)]
    rows += [(f"  {reason}", n) for reason, n in sorted(counts.quarantined_by_reason.items())]
    rows += [("quarantine fraction", f"{counts.quarantine_fraction:.3f}"), ("train pairs", counts.train_pairs),
             ("held-out pairs", counts.heldout_pairs), ("ppo-split pairs", counts.ppo_split_pairs),
             ("ppo prompts", counts.ppo_prompts), ("lengths counted in", counts.length_unit),
             ("max_length", "no limit" if counts.max_length is None else f"{counts.max_length} {counts.length_unit}")]
    if counts.max_prompt_length is not None:  # shown only when set: most data has no prompt cap
        rows.append(("max_prompt_length", f"{counts.max_prompt_length} {counts.length_unit}"))
    rows += [("max_chars", "no cap" if counts.max_chars is None else f"{counts.max_chars} characters")]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)
